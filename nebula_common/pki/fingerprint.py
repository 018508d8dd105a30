"""SHA-256 fingerprints of CA certificates, as two organisations read them to each other.

The fingerprint is what makes a CA certificate received by e-mail or chat safe to trust: each side
reads the other's ``SHA256:AB:CD:...`` over a second channel (a call, a signed letter) and
``nebula pki trust add`` refuses the file unless it matches. The parser is lenient about the
spelling people paste (prefix or not, colons or not, any case) and strict about the value.
"""

from __future__ import annotations

import re

from cryptography import x509
from cryptography.hazmat.primitives import hashes

__all__ = ["FINGERPRINT_PREFIX", "format_fingerprint", "parse_fingerprint"]

FINGERPRINT_PREFIX = "SHA256:"
_HEX_RE = re.compile(r"[0-9a-f]{64}")


def format_fingerprint(cert: x509.Certificate) -> str:
    """``SHA256:`` and the certificate's DER SHA-256 in upper-case hex pairs joined by colons."""
    return FINGERPRINT_PREFIX + cert.fingerprint(hashes.SHA256()).hex(":").upper()


def parse_fingerprint(text: str) -> bytes:
    """The 32 digest bytes of a fingerprint as printed by ``nebula pki export-ca`` or openssl.

    Accepts ``SHA256:AB:CD:..``, ``sha256 Fingerprint=AB:CD:..`` (``openssl x509 -fingerprint
    -sha256``) and bare hex with or without colons or spaces. Raises ``ValueError`` naming the problem.
    """
    value = text.strip()
    lowered = value.lower()
    for prefix in ("sha256 fingerprint=", "sha256:", "sha256="):
        if lowered.startswith(prefix):
            value = value[len(prefix) :]
            break
    digits = re.sub(r"[\s:]", "", value).lower()
    if not _HEX_RE.fullmatch(digits):
        raise ValueError(
            f"not a SHA-256 fingerprint: {text!r} (expected 64 hex digits, e.g. as `nebula pki export-ca` "
            "prints it: SHA256:AB:CD:...)"
        )
    return bytes.fromhex(digits)
