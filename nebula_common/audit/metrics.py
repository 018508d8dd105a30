"""What an operator's alerts need to know about a service's audit log: room left, and writes lost.

A service refuses an audited operation whose record cannot be written, so a full audit disk stops
the cluster; these series let the ``NebulaAuditDiskLow`` and ``NebulaAuditWriteFailing`` alerts
(``docker/monitoring/alerts.yml``) say so before and when it happens.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from prometheus_client import Counter, Gauge

WRITE_FAILURES = Counter(
    "nebula_audit_write_failures",
    "Audit records this service could not write (the operation failed).",
    ["service"],
)
WRITABLE = Gauge(
    "nebula_audit_writable",
    "1 while this service's audit log takes records, 0 from a failed write until one succeeds again "
    "(also the health of nebula.v1.AuditLog).",
    ["service"],
)
DISK_FREE = Gauge(
    "nebula_audit_disk_free_bytes",
    "Free bytes on the file system holding this service's audit log.",
    ["service"],
)
DISK_FREE_RATIO = Gauge(
    "nebula_audit_disk_free_ratio",
    "Free fraction of the file system holding this service's audit log.",
    ["service"],
)


def _usage(directory: Path) -> tuple[float, float]:
    try:
        usage = shutil.disk_usage(directory)
    except OSError:  # gone or unreadable: report no room, which is what the service will find
        return 0.0, 0.0
    return float(usage.free), usage.free / usage.total if usage.total else 0.0


def watch_audit_disk(directory: Path, service: str) -> None:
    """Export the room left beside ``directory``'s audit log, measured at every scrape."""
    WRITE_FAILURES.labels(service)  # a zero from the start: increase() sees the first failure
    DISK_FREE.labels(service).set_function(lambda: _usage(directory)[0])
    DISK_FREE_RATIO.labels(service).set_function(lambda: _usage(directory)[1])
