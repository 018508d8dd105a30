"""The key that seals one service's audit log.

Each service seals its own log with its own dedicated P-256 key (not its TLS or token key): a
seal key that never leaves the service's data dir and is used for nothing else cannot be made to
sign anything but seals, and rotating TLS certificates or token keys never invalidates old seals.
The public half is written next to the private key so an auditor can copy it somewhere safe
*once*; verifying later against that copy is what makes a rewritten log (with a swapped key)
detectable.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from nebula_common.durable import atomic_write, create_new

__all__ = [
    "PRIVATE_KEY_NAME",
    "PUBLIC_KEY_NAME",
    "AuditKeyError",
    "AuditSigner",
    "SealVerifier",
    "adopt_key",
    "canonical_json",
    "key_id_of",
]

PRIVATE_KEY_NAME = "audit-key.pem"
PUBLIC_KEY_NAME = "audit-key.pub.pem"


class AuditKeyError(Exception):
    """The audit key is missing, malformed, or not an ECDSA P-256 key."""


def canonical_json(document: Any) -> bytes:
    """The exact bytes that are hashed and signed: sorted keys, no whitespace, UTF-8.

    Hashing a canonical form (not the line as written) means a verifier never depends on how a
    JSON library happened to order or space the record.
    """
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def key_id_of(public_key: ec.EllipticCurvePublicKey) -> str:
    """First 16 hex chars of SHA-256 over the DER public key: short enough to print, long enough to pin."""
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()[:16]


@dataclass(frozen=True)
class AuditSigner:
    """A loaded seal key: signs seal payloads, exposes the public key for verification."""

    private_key: ec.EllipticCurvePrivateKey
    key_id: str

    @classmethod
    def load_or_create(cls, directory: Path) -> AuditSigner:
        """Load ``<directory>/audit-key.pem`` or create it (0600) with its public twin (0644).

        Creation is idempotent under a race: :func:`~nebula_common.durable.create_new` links the
        private key into place, which fails if another process won, and then the winner's key is loaded.
        """
        directory = Path(directory)
        key_path = directory / PRIVATE_KEY_NAME
        if not key_path.exists():
            directory.mkdir(parents=True, exist_ok=True)
            key = ec.generate_private_key(ec.SECP256R1())
            pem = key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
            create_new(key_path, pem, mode=0o600)  # False: another process won; its key is loaded
        try:
            loaded = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        except (ValueError, TypeError) as exc:
            raise AuditKeyError(f"{key_path} is not an unencrypted PEM private key: {exc}") from exc
        if not isinstance(loaded, ec.EllipticCurvePrivateKey) or not isinstance(loaded.curve, ec.SECP256R1):
            raise AuditKeyError(f"{key_path} is not an ECDSA P-256 private key")
        signer = cls(loaded, key_id_of(loaded.public_key()))
        public_path = directory / PUBLIC_KEY_NAME
        public_pem = signer.public_pem()
        if not public_path.exists() or public_path.read_bytes() != public_pem:
            atomic_write(public_path, public_pem, mode=0o644)
        return signer

    def public_pem(self) -> bytes:
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def sign(self, payload: dict[str, Any]) -> str:
        """Base64 DER ECDSA-SHA256 signature over the canonical JSON of ``payload``."""
        signature = self.private_key.sign(canonical_json(payload), ec.ECDSA(hashes.SHA256()))
        return base64.b64encode(signature).decode()

    def verifier(self) -> SealVerifier:
        return SealVerifier(self.private_key.public_key())


@dataclass(frozen=True)
class SealVerifier:
    """Checks seal signatures against one pinned public key."""

    public_key: ec.EllipticCurvePublicKey

    @property
    def key_id(self) -> str:
        return key_id_of(self.public_key)

    @classmethod
    def from_pem(cls, pem: bytes, *, source: str = "public key") -> SealVerifier:
        try:
            key = serialization.load_pem_public_key(pem)
        except ValueError as exc:
            raise AuditKeyError(f"{source} is not a PEM public key: {exc}") from exc
        if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
            raise AuditKeyError(f"{source} is not an ECDSA P-256 public key")
        return cls(key)

    @classmethod
    def from_file(cls, path: Path) -> SealVerifier:
        try:
            return cls.from_pem(Path(path).read_bytes(), source=str(path))
        except FileNotFoundError:
            raise AuditKeyError(f"missing audit public key {path}") from None

    def valid(self, payload: dict[str, Any], signature_b64: str) -> bool:
        try:
            signature = base64.b64decode(signature_b64, validate=True)
            self.public_key.verify(signature, canonical_json(payload), ec.ECDSA(hashes.SHA256()))
        except (InvalidSignature, ValueError, TypeError):
            return False
        return True


def adopt_key(service_dir: Path, signer_dir: Path, *, log: str) -> bool:
    """Move ``service_dir``'s seal key into ``signer_dir`` (made 0700); whether there was one to move.

    The key a service kept before the audit signer held it: moved, never copied or replaced, so its old
    seals still verify and no copy stays where the service reads. A key in both places stops it, naming
    both (only the operator can tell which one verifies the log).
    """
    old, new = service_dir / PRIVATE_KEY_NAME, signer_dir / PRIVATE_KEY_NAME
    if not old.exists():
        return False
    if new.exists():
        raise AuditKeyError(
            f"{old} and {new} are both audit keys of {log}: keep the one whose public half verifies the "
            "log (nebula audit verify) in the signer's directory and delete the other"
        )
    signer_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        os.replace(old, new)
    except OSError:  # two volumes: write the signer's copy whole and durable, then remove the service's
        atomic_write(new, old.read_bytes(), mode=0o600)
        old.unlink()
    return True
