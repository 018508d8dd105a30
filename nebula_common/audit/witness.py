"""Witnessed audit: prove that a log was not rewritten after another organisation saw its head.

A seal proves a log is what the holder of its signing key wrote; it cannot prove that the holder (or
whoever broke into the service and read the key) did not rewrite history and re-sign it. So each switch
sends the head of its audit chain (log id, record count, hash of the last record) to its peer over the
authenticated link at a fixed interval, and the peer records each head in its *own* audit log as an
``audit.witness`` record (``services/switch/witness.py``). :func:`check_witnessed` then compares a log
with every head another log witnessed of it: record ``count`` must still exist and still hash to
``head``. A rewrite of any record up to a witnessed count changes that record's hash or the hash of every
record after it (the chain), so it is caught however well the rewriter re-signed the result; cutting the
log short of a witnessed count is caught too. Records after the newest witnessed head are protected by
the seals only.

The witness log's own integrity is proven by verifying it with its owner's pinned key (``nebula audit
verify``); this module reads it as evidence and checks only that it is well formed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nebula_common.audit.segments import segments

__all__ = ["WITNESS_EVENT", "WitnessResult", "check_witnessed", "witnessed_heads"]

WITNESS_EVENT = "audit.witness"


@dataclass(frozen=True)
class WitnessResult:
    """Outcome of :func:`check_witnessed`; ``reason`` says what failed when ``ok`` is False."""

    ok: bool
    log_id: str
    heads: int
    """Witnessed heads of this log found in the witness log (all checked when ok)."""
    witnessed_through: int
    """Highest record count a witness vouches for (0: none)."""
    witnessed_at: str
    """When the witness recorded that head (its clock)."""
    witness: str
    """Who witnessed it: ``<service>/<cluster>`` of the witness log's records."""
    reason: str = ""


def _records(path: Path) -> list[dict[str, Any]]:
    records = []
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}: line {number} is not JSON ({exc})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}: line {number} is not a JSON object")
            records.append(record)
    return records


def witnessed_heads(witness_log: Path, log_id: str) -> list[dict[str, Any]]:
    """The ``audit.witness`` records of ``witness_log`` about the log ``log_id``, in the order written."""
    heads = []
    for record in _records(witness_log):
        details = record.get("details")
        if (
            record.get("event") == WITNESS_EVENT
            and isinstance(details, dict)
            and details.get("log_id") == log_id
        ):
            heads.append(record)
    return heads


def check_witnessed(log: Path, witness_log: Path) -> WitnessResult:
    """Compare ``log`` (all its segments) with every head ``witness_log`` recorded of it; heads of
    records in segments rotated away are skipped (ValueError: a file unreadable)."""
    records = [record for segment in segments(log) or [log] for record in _records(segment)]
    if not records:
        return WitnessResult(False, "", 0, 0, "", "", f"{log} is empty")
    first = records[0].get("seq")
    offset = first - 1 if isinstance(first, int) and not isinstance(first, bool) and first >= 1 else 0
    details = records[0].get("details")
    log_id = str(details.get("log_id", "")) if isinstance(details, dict) else ""
    if not log_id:
        return WitnessResult(False, "", 0, 0, "", "", f"{log}: its first record names no log_id")
    heads = witnessed_heads(witness_log, log_id)
    through, at, witness = 0, "", ""

    def failed(reason: str) -> WitnessResult:
        return WitnessResult(False, log_id, len(heads), through, at, witness, reason)

    if not heads:
        return failed(f"{witness_log} witnessed no head of log {log_id}")
    for record in heads:
        seen = record["details"]
        count, head = seen.get("count"), seen.get("head")
        who = f"{record.get('service', '?')}/{record.get('cluster', '?')}"
        when = str(record.get("ts", ""))
        if not isinstance(count, int) or isinstance(count, bool) or count < 1 or not isinstance(head, str):
            return failed(f"{witness_log}: witness record {record.get('seq')} is malformed")
        if count <= offset:
            continue  # in a segment rotated away
        if count > offset + len(records):
            return failed(
                f"TRUNCATED: {who} witnessed {count} records at {when}, the log has {offset + len(records)}"
            )
        kept = records[count - 1 - offset]
        if kept.get("seq") != count or kept.get("hash") != head:
            return failed(
                f"REWRITTEN: record {count} (or one before it) is not what {who} witnessed at {when}: "
                f"witnessed hash {head[:16]}..., the log has {str(kept.get('hash'))[:16]}..."
            )
        if count >= through:
            through, at, witness = count, when, who
    if not through:
        return failed(f"every head witnessed of log {log_id} lies in segments rotated away")
    return WitnessResult(True, log_id, len(heads), through, at, witness)
