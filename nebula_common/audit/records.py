"""The audit record format: its fields' constants, the hash that chains records, what a seal signs.

Record format (every field always present)::

    {"v": 1, "seq": 7, "ts": "2025-01-01T12:00:00.123456Z", "service": "switch", "cluster": "a",
     "event": "link.refused", "outcome": "refused", "account": "", "job_id": "",
     "details": {...}, "prev": "<hash of record 6>", "hash": "<sha256 of this record without 'hash'>"}

``seq`` counts from 1 with no gaps; record 1 (``audit.open`` of a new file) has ``prev`` =
64 zeros and carries the log's random ``log_id``. ``hash`` is SHA-256 over the canonical JSON of
the record without ``hash``, so editing any field breaks it and deleting, inserting or reordering
lines breaks ``seq`` and ``prev``.

Shared by the writer (:mod:`nebula_common.audit.log`), the verifier and the seal keeper, so each reads
one definition of a record rather than its own.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from nebula_common.audit.signing import canonical_json

__all__ = [
    "FORMAT_VERSION",
    "GENESIS_PREV",
    "OPEN_EVENT",
    "OUTCOMES",
    "RESUMED_EVENT",
    "SEAL_EVENT",
    "AuditError",
    "record_hash",
    "seal_payload",
    "utc_timestamp",
]

FORMAT_VERSION = 1
GENESIS_PREV = "0" * 64
SEAL_EVENT = "audit.seal"
OPEN_EVENT = "audit.open"
OUTCOMES = frozenset({"ok", "failure", "refused"})
RESUMED_EVENT = "audit.resumed"
"""First record after writes failed (a full disk): how many failed and since when."""


class AuditError(Exception):
    """The audit log cannot be opened or appended to; the message names the file and why."""


def utc_timestamp(when: float | None = None) -> str:
    """RFC 3339 UTC with microseconds: sortable as text and parseable by ``datetime.fromisoformat``."""
    moment = datetime.fromtimestamp(time.time() if when is None else when, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def record_hash(record: Mapping[str, Any]) -> str:
    """SHA-256 (hex) over the canonical JSON of ``record`` without its ``hash`` field."""
    body = {key: value for key, value in record.items() if key != "hash"}
    return hashlib.sha256(canonical_json(body)).hexdigest()


def seal_payload(log_id: str, count: int, head: str, ts: str) -> dict[str, Any]:
    """What a seal signs: which log, how many records, the hash of the last one, and when."""
    return {"log_id": log_id, "count": count, "head": head, "ts": ts}
