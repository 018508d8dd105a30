"""Tamper-evident audit logs: hash-chained JSON lines, sealed with a per-service signature.

``open_service_audit(data_dir, ...)`` is what a service calls at start-up; ``verify_log`` is what
``nebula audit verify`` runs; ``AuditServicer`` serves the admin-only query API.
"""

from __future__ import annotations

from pathlib import Path

from nebula_common.audit.log import SEAL_INTERVAL_S, AuditError, AuditLog, record_hash, seal_path_for
from nebula_common.audit.metrics import watch_audit_disk
from nebula_common.audit.query import AuditFilter, QueryResult, query_log
from nebula_common.audit.signing import PUBLIC_KEY_NAME, AuditKeyError, AuditSigner, SealVerifier
from nebula_common.audit.verify import VerifyResult, verify_log

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
) -> AuditLog:
    """Open (or start) ``<data_dir>/audit.log`` sealed by ``<data_dir>/audit-key.pem``."""
    data_dir = Path(data_dir)
    signer = AuditSigner.load_or_create(data_dir)
    watch_audit_disk(data_dir, service)
    return AuditLog(
        data_dir / LOG_FILE_NAME,
        signer,
        service=service,
        cluster=cluster,
        seal_every=seal_every,
        seal_interval_s=seal_interval_s,
        fsync_each=fsync_each,
    )
