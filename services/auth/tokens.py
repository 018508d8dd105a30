"""Signing tokens for one cluster's accounts.

Tokens are ES256 JWTs: asymmetric, so the switch and trainer verify them with
the public key alone and a compromised verifier cannot mint tokens. The signing
key lives next to the account database and survives restarts, so tokens issued
before a restart stay valid and verifiers need not refetch keys.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from jwt.algorithms import ECAlgorithm

from nebula_common.auth.key_source import ALGORITHM, issuer_for
from nebula_common.auth.verifier import AUDIENCE, JOB_ROLE, LEEWAY_SECONDS, TokenVerifier
from nebula_common.durable import atomic_write, create_new

logger = logging.getLogger(__name__)

KEY_FILE_NAME = "signing-key.pem"
RETIRED_KEYS_FILE_NAME = "retired-signing-keys.json"
"""Public halves of rotated-out keys, kept while tokens they signed can still be valid."""
DEFAULT_TTL_SECONDS = 3600
DEFAULT_JOB_TTL_SECONDS = 900
"""Lifetime of a job token: the trainer renews it at half-life, so a stolen one is soon worthless."""


@dataclass(frozen=True)
class IssuedToken:
    token: str
    expires_at: int
    jti: str


def key_id(public_key: ec.EllipticCurvePublicKey) -> str:
    """Stable id of a public key: first 16 hex chars of SHA-256 over its DER encoding."""
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()[:16]


def load_or_create_signing_key(path: Path) -> ec.EllipticCurvePrivateKey:
    """Load the P-256 key at ``path``, creating it (0600, atomically) on first start.

    The new key is written to a temporary file and hard-linked into place, which
    fails instead of overwriting if another process won the race; we then load
    the winner's key so both agree.
    """
    if not path.exists():
        _create_key_file(path)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        logger.warning(
            "signing key file is readable by group or others",
            extra={"fields": {"path": str(path), "mode": oct(mode)}},
        )
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
        raise ValueError(f"{path} does not hold an EC P-256 private key")
    return key


def _create_key_file(path: Path) -> None:
    """Write a fresh P-256 key to ``path`` (0600) unless another process just created one."""
    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    create_new(path, pem, mode=0o600)  # False: a racing process won; its key is loaded by the caller


class TokenIssuer:
    """Issues ES256 tokens for the accounts of ``cluster_id``."""

    def __init__(
        self,
        data_dir: Path,
        cluster_id: str,
        ttl_seconds: int = DEFAULT_TTL_SECONDS,
        job_ttl_seconds: int = DEFAULT_JOB_TTL_SECONDS,
    ) -> None:
        if ttl_seconds <= 0 or job_ttl_seconds <= 0:
            raise ValueError("token ttl_seconds and job_ttl_seconds must be positive")
        self._cluster_id = cluster_id
        self._issuer = issuer_for(cluster_id)
        self._ttl = ttl_seconds
        # Never longer than an account token: revocations and retired keys are kept for one account
        # token lifetime, which must cover every token still valid.
        self._job_ttl = min(job_ttl_seconds, ttl_seconds)
        self._key_path = Path(data_dir) / KEY_FILE_NAME
        self._retired_path = Path(data_dir) / RETIRED_KEYS_FILE_NAME
        self._private_key = load_or_create_signing_key(self._key_path)
        self._public_key = self._private_key.public_key()
        self._kid = key_id(self._public_key)
        self._retired = self._load_retired()

    @property
    def cluster_id(self) -> str:
        return self._cluster_id

    @property
    def issuer(self) -> str:
        return self._issuer

    @property
    def ttl_seconds(self) -> int:
        return self._ttl

    @property
    def job_ttl_seconds(self) -> int:
        return self._job_ttl

    @property
    def kid(self) -> str:
        return self._kid

    @property
    def key_path(self) -> Path:
        return self._key_path

    def issue(self, username: str, role: str, *, now: float | None = None) -> IssuedToken:
        """Sign a token for ``username``; ``now`` is overridable so tests can mint old tokens."""
        return self._sign(username, role, self._ttl, {}, now)

    def issue_job(self, username: str, job_id: str, *, now: float | None = None) -> IssuedToken:
        """Sign a job token: acts for ``username`` in ``job_id`` only (``policy.JOB_METHODS``)."""
        if not job_id:
            raise ValueError("a job token needs a job id")
        return self._sign(username, JOB_ROLE, self._job_ttl, {"job": job_id}, now)

    def _sign(
        self, username: str, role: str, ttl: int, extra: dict[str, Any], now: float | None
    ) -> IssuedToken:
        issued_at = int(time.time() if now is None else now)
        expires_at = issued_at + ttl
        jti = secrets.token_urlsafe(16)
        claims: dict[str, Any] = {
            "iss": self._issuer,
            "aud": AUDIENCE,
            "sub": username,
            "role": role,
            "cluster": self._cluster_id,
            "iat": issued_at,
            "nbf": issued_at,
            "exp": expires_at,
            "jti": jti,
            **extra,
        }
        token = jwt.encode(claims, self._private_key, algorithm=ALGORITHM, headers={"kid": self._kid})
        return IssuedToken(token=token, expires_at=expires_at, jti=jti)

    def jwks(self, *, now: float | None = None) -> dict[str, Any]:
        """The public signing keys as a JWK set (RFC 7517): the current key first, then retired keys
        that may still have valid tokens out there (retired less than a token lifetime + leeway ago)."""
        moment = time.time() if now is None else now
        keys = [_public_jwk(self._public_key, self._kid)]
        horizon = self._ttl + LEEWAY_SECONDS
        keys += [
            {k: v for k, v in entry.items() if k != "retired_at"}
            for entry in self._retired
            if moment - float(entry["retired_at"]) <= horizon
        ]
        return {"keys": keys}

    def rotate(self) -> tuple[str, str]:
        """Start signing with a fresh key; the old public key stays published for one token lifetime.

        Order matters for crash safety: the retired list (with the old public key) is written before
        the new private key replaces the old one, so no moment exists where tokens signed by the old
        key could not be verified. Returns (old kid, new kid).
        """
        old_kid = self._kid
        retired = [*self._retired, {**_public_jwk(self._public_key, old_kid), "retired_at": time.time()}]
        horizon = self._ttl + LEEWAY_SECONDS
        retired = [e for e in retired if time.time() - float(e["retired_at"]) <= horizon]
        atomic_write(self._retired_path, json.dumps({"keys": retired}, sort_keys=True).encode(), mode=0o600)
        new_key = ec.generate_private_key(ec.SECP256R1())
        pem = new_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        atomic_write(self._key_path, pem, mode=0o600)
        self._private_key, self._public_key = new_key, new_key.public_key()
        self._kid = key_id(self._public_key)
        self._retired = retired
        return old_kid, self._kid

    def _load_retired(self) -> list[dict[str, Any]]:
        try:
            document = json.loads(self._retired_path.read_bytes())
        except FileNotFoundError:
            return []
        except ValueError as exc:
            raise ValueError(f"{self._retired_path} is not valid JSON: {exc}") from exc
        keys = document.get("keys") if isinstance(document, dict) else None
        if not isinstance(keys, list) or not all(isinstance(k, dict) and "retired_at" in k for k in keys):
            raise ValueError(f"{self._retired_path} must hold {{'keys': [jwk with retired_at, ...]}}")
        return keys

    def verifier(self) -> TokenVerifier:
        """A verifier for this issuer's own tokens, without a network round trip."""
        return TokenVerifier(self._cluster_id, json.dumps(self.jwks()))


def _public_jwk(public_key: ec.EllipticCurvePublicKey, kid: str) -> dict[str, Any]:
    jwk = ECAlgorithm.to_jwk(public_key, as_dict=True)
    jwk.update({"kid": kid, "use": "sig", "alg": ALGORITHM})
    return jwk
