"""Tamper-evident audit logs: hash-chained JSON lines, sealed with a per-service signature.

``open_service_audit(data_dir, ...)`` is what a service calls at start-up; ``verify_log`` is what
``nebula audit verify`` runs; ``AuditServicer`` serves the admin-only query API.
"""

from __future__ import annotations

from pathlib import Path

from nebula_common.audit.log import SEAL_INTERVAL_S, AuditLog
from nebula_common.audit.metrics import watch_audit_disk
from nebula_common.audit.query import AuditFilter, QueryResult, query_log
from nebula_common.audit.records import AuditError, record_hash
from nebula_common.audit.segments import seal_path_for
from nebula_common.audit.signing import (
    PRIVATE_KEY_NAME,
    PUBLIC_KEY_NAME,
    AuditKeyError,
    AuditSigner,
    SealVerifier,
)
from nebula_common.audit.verify import VerifyResult, verify_log
from nebula_common.durable import atomic_write

__all__ = [
    "LOG_FILE_NAME",
    "PUBLIC_KEY_NAME",
    "AuditError",
    "AuditFilter",
    "AuditKeyError",
    "AuditLog",
    "AuditSigner",
    "QueryResult",
    "SealVerifier",
    "VerifyResult",
    "open_service_audit",
    "query_log",
    "record_hash",
    "seal_path_for",
    "verify_log",
]

LOG_FILE_NAME = "audit.log"


def open_service_audit(
    data_dir: Path,
    *,
    service: str,
    cluster: str,
    seal_every: int = 64,
    seal_interval_s: float = SEAL_INTERVAL_S,
    fsync_each: bool = True,
    signer: str = "",
) -> AuditLog:
    """Open (or start) ``<data_dir>/audit.log``, sealed by ``<data_dir>/audit-key.pem`` or, with ``signer``
    (``unix:<path>``), by the audit signer there, which holds the key (``remote_signer.py``).

    With a signer the service must not hold a key of its own (whoever reads it could re-sign a
    rewritten past): one left in ``data_dir`` stops the start, naming it. The signer's public key is
    written to ``<data_dir>/audit-key.pub.pem`` for ``nebula audit verify``.
    """
    data_dir = Path(data_dir)
    if signer:
        from nebula_common.audit.remote_signer import RemoteSigner

        own = data_dir / PRIVATE_KEY_NAME
        if own.exists():
            raise AuditError(
                f"{own} is an audit key this service could read, but its seals are made by the signer at "
                f"{signer}: move the key to the signer's directory (local up, compose's signer-init and "
                "the Kubernetes pods' adopt-audit-key container do) or delete it"
            )
        remote = RemoteSigner(signer)
        data_dir.mkdir(parents=True, exist_ok=True)
        public = data_dir / PUBLIC_KEY_NAME
        if not public.exists() or public.read_bytes() != remote.public_pem():
            atomic_write(public, remote.public_pem(), mode=0o644)
        keys: AuditSigner | RemoteSigner = remote
    else:
        keys = AuditSigner.load_or_create(data_dir)
    watch_audit_disk(data_dir, service)
    return AuditLog(
        data_dir / LOG_FILE_NAME,
        keys,  # type: ignore[arg-type]
        service=service,
        cluster=cluster,
        seal_every=seal_every,
        seal_interval_s=seal_interval_s,
        fsync_each=fsync_each,
    )
