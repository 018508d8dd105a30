"""A trainer's audit log in a test's directory, as ``start_trainer`` opens it (its own key beside it)."""

from __future__ import annotations

from pathlib import Path

from nebula_common.audit import AuditLog
from nebula_common.audit.signing import AuditSigner


def trainer_audit(root: Path, cluster: str = "a") -> AuditLog:
    """``root/trainer/audit.log``, sealed with a key kept in ``root/trainer``; the caller closes it."""
    return AuditLog(
        root / "trainer" / "audit.log",
        AuditSigner.load_or_create(root / "trainer"),
        service="trainer",
        cluster=cluster,
    )
