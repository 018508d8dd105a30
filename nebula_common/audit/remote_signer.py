"""A service's seal signer when its key lives with an audit signer process (``services/signer``).

``RemoteSigner`` stands where ``AuditSigner`` does in ``AuditLog``: ``key_id``, ``public_pem()`` and
``sign(payload, records)``. It holds no key: each seal goes to the signer on the service's own Unix
socket with the records written since the last signature (``audit_signer.proto``), and the signature
that comes back is checked against the public key before it is written anywhere. A signer that is
restarting is waited for (``TIMEOUT_S``); one that refuses (the log does not extend what it sealed)
makes the seal fail with its reason, as a full disk does.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from nebula_common.audit.records import AuditError
from nebula_common.audit.seal_keeper import SealPosition
from nebula_common.audit.signing import SealVerifier
from nebula_common.proto.nebula.v1 import audit_signer_pb2, audit_signer_pb2_grpc
from nebula_common.rpc.unix_paths import held_directory_path

__all__ = ["MAX_MESSAGE_BYTES", "TIMEOUT_S", "RemoteSigner", "short_unix_target"]

TIMEOUT_S = 15.0
"""How long a seal waits for the signer (a restarted one is back within a few seconds)."""
MAX_MESSAGE_BYTES = 256 << 20
"""Largest request: the records since the last seal, after a long wait for the signer."""


def short_unix_target(path: Path) -> tuple[int, str]:
    """A ``unix:`` target for the socket ``path`` within the kernel's 108-byte limit at any depth.

    The socket's directory is held open (``O_PATH``) and named through ``/proc/self/fd``, which the
    kernel resolves to it on bind and on connect. The caller keeps the descriptor open as long as the
    target is used (gRPC reconnects through it) and closes it after.
    """
    fd, short = held_directory_path(path)
    return fd, f"unix:{short}"


class RemoteSigner:
    """Seals signed by the audit signer at ``target`` (``unix:<path>``); see the module docstring."""

    needs_records = True
    """``AuditLog`` keeps the records written since the last signature and sends them with each seal."""

    def __init__(self, target: str, *, timeout_s: float = TIMEOUT_S) -> None:
        if not target.startswith("unix:/"):
            raise AuditError(f"audit signer {target!r}: expected unix:<absolute socket path>")
        self.target = target
        self._timeout_s = timeout_s
        try:
            self._directory, short = short_unix_target(Path(target.removeprefix("unix:")))
        except OSError as exc:
            raise AuditError(f"audit signer {target}: its socket's directory: {exc.strerror}") from None
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        self._channel = grpc.insecure_channel(short, options=options)  # a Unix socket: no network hop
        self._stub = audit_signer_pb2_grpc.AuditSignerStub(self._channel)
        key = self._call("GetSealKey", audit_signer_pb2.GetSealKeyRequest())
        self.key_id: str = key.key_id
        self._public_pem = bytes(key.public_pem)
        self._verifier = SealVerifier.from_pem(self._public_pem, source=f"the audit signer at {target}")
        #: Where the signer's chain stood at start: ``AuditLog`` sends the records after it first.
        self.position = SealPosition(key.log_id, key.count, key.head)

    def _call(self, method: str, request: Any) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=self._timeout_s, wait_for_ready=True)
        except grpc.RpcError as exc:
            raise AuditError(f"audit signer {self.target}: {exc.code().name}: {exc.details()}") from None

    def public_pem(self) -> bytes:
        return self._public_pem

    def sign(self, payload: dict[str, Any], records: Sequence[bytes] = ()) -> str:
        """The signer's signature over ``payload``, which ``records`` lead to (``AuditError`` if refused)."""
        request = audit_signer_pb2.SignSealRequest(
            log_id=payload["log_id"],
            count=payload["count"],
            head=payload["head"],
            ts=payload["ts"],
            records=list(records),
        )
        signed = self._call("SignSeal", request)
        if signed.key_id != self.key_id or not self._verifier.valid(payload, signed.sig):
            raise AuditError(f"audit signer {self.target} answered with a signature its key does not verify")
        return str(signed.sig)

    def close(self) -> None:
        self._channel.close()
        os.close(self._directory)
