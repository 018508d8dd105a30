"""Verification of an audit log written by :class:`nebula_common.audit.log.AuditLog`.

What a successful verification guarantees, exactly (the key is the *pinned* public key):

* Records 1..S, where S is the count in the newest valid seal (the ``.seal`` file, or the last
  in-log seal record if that is newer), are exactly what the service wrote: any edit, deletion,
  reordering, insertion or truncation among them is detected, even by an attacker who can rewrite
  the files and recompute every hash, because that attacker cannot produce a seal signature.
* Records after S (at most ``seal_every`` records or ``seal_interval_s`` seconds of events; none
  after a graceful stop, which seals) are protected by the hash chain only: naive edits,
  deletions, reorderings and insertions are detected, but someone who recomputes hashes can rewrite
  them, and cutting them off entirely is indistinguishable from the service not having written them.
* Not detectable from the files alone: replacing *both* the log and the ``.seal`` file with an
  older genuine copy (a rollback). ``max_seal_age`` turns a stale seal into a failure; shipping
  seals off the host closes the gap completely.

The first bad record is named by its ``seq``. A rotated segment starts with an ``audit.open`` record
naming the seq and hash it continues; ``verify_segments`` checks every segment kept and that each
continues the one before it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from nebula_common.audit.records import (
    FORMAT_VERSION,
    GENESIS_PREV,
    OPEN_EVENT,
    SEAL_EVENT,
    record_hash,
    seal_payload,
)
from nebula_common.audit.segments import seal_path_for, segments
from nebula_common.audit.signing import SealVerifier

__all__ = ["REQUIRED_FIELDS", "VerifyResult", "verify_log", "verify_segments"]

REQUIRED_FIELDS: dict[str, type | tuple[type, ...]] = {
    "v": int,
    "seq": int,
    "ts": str,
    "service": str,
    "cluster": str,
    "event": str,
    "outcome": str,
    "account": str,
    "job_id": str,
    "details": dict,
    "prev": str,
    "hash": str,
}


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of :func:`verify_log`; ``first_bad`` and ``reason`` are set when ``ok`` is False."""

    ok: bool
    records: int
    """Records read (all lines when ok; the ones before the first bad record otherwise)."""
    sealed_through: int
    """Highest record number covered by a valid signature."""
    sealed_at: str
    key_id: str
    first_bad: int | None = None
    reason: str = ""
    first_record: int = 1
    """Seq of the first record read (above 1 when older segments were rotated away)."""
    head: str = ""
    """Hash of the last record read."""

    @property
    def unsealed_tail(self) -> int:
        """Records protected by the hash chain only (written after the newest seal)."""
        return max(0, self.records - self.sealed_through)


class _Bad(Exception):
    def __init__(self, line: int, reason: str) -> None:
        super().__init__(reason)
        self.line = line
        self.reason = reason


def _parse_time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _check_fields(record: Any, line: int) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise _Bad(line, f"record {line} is not a JSON object")
    for name, kind in REQUIRED_FIELDS.items():
        if name not in record:
            raise _Bad(line, f"record {line} lacks field {name!r}")
        value = record[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise _Bad(line, f"record {line} field {name!r} has the wrong type")
    if record["v"] != FORMAT_VERSION:
        raise _Bad(line, f"record {line} has format version {record['v']}, expected {FORMAT_VERSION}")
    return record


def verify_log(
    path: Path,
    verifier: SealVerifier,
    *,
    seal_path: Path | None = None,
    require_seal_file: bool = True,
    max_seal_age: timedelta | None = None,
    now: datetime | None = None,
) -> VerifyResult:
    """Check the chain, every in-log seal and the external seal of the log at ``path``."""
    path = Path(path)
    seal_path = seal_path_for(path) if seal_path is None else Path(seal_path)
    count = 0
    sealed_through = 0
    sealed_at = ""
    last_seal_line = 0
    prev = GENESIS_PREV
    log_id = ""
    hashes: list[str] = []
    # Read the seal before the log: a live service appends a record before it seals it, so a seal
    # read first never covers more than the log read after it (the reverse order races a live log).
    try:
        seal_bytes: bytes | None = seal_path.read_bytes()
    except FileNotFoundError:
        seal_bytes = None
    try:
        with open(path, "rb") as handle:
            raw_lines = handle.readlines()
    except FileNotFoundError:
        return VerifyResult(False, 0, 0, "", verifier.key_id, 1, f"audit log {path} does not exist")

    base = 0  # seq of the record before this file's first (a segment continuing a rotated one)

    def fail(bad: _Bad) -> VerifyResult:
        return VerifyResult(
            False, bad.line - 1, sealed_through, sealed_at, verifier.key_id, bad.line, bad.reason, base + 1
        )

    def tampered(first_bad: int | None, reason: str) -> VerifyResult:
        """A failed verdict that still reports how far the log checked out (read at call time)."""
        return VerifyResult(
            False, count, sealed_through, sealed_at, verifier.key_id, first_bad, reason, base + 1
        )

    try:
        for index, raw in enumerate(raw_lines, 1):
            line_no = base + index  # the record number this line must hold
            if not raw.endswith(b"\n"):
                raise _Bad(line_no, f"record {line_no} is incomplete (the file was cut inside it)")
            try:
                record = _check_fields(json.loads(raw), line_no)
            except ValueError as exc:
                raise _Bad(line_no, f"record {line_no} is not valid JSON ({exc})") from None
            if index == 1 and (start := _continues(record)) is not None:
                base, prev = start
                line_no, last_seal_line = base + 1, base
            seq = record["seq"]
            if seq != line_no:
                if seq == line_no - 1:
                    # Either of the two may be the forgery; name the first record involved.
                    raise _Bad(
                        line_no - 1,
                        f"records {line_no - 1} and {line_no} both claim seq {seq}: a record was inserted",
                    )
                raise _Bad(
                    line_no,
                    f"record {line_no} carries seq {seq}: records were deleted, inserted or reordered here",
                )
            if record["prev"] != prev:
                raise _Bad(
                    line_no,
                    f"record {line_no} does not chain to record {line_no - 1} (prev hash "
                    "differs): the record before it was edited, removed or replaced",
                )
            if record_hash(record) != record["hash"]:
                raise _Bad(line_no, f"record {line_no} does not match its hash: it was edited")
            if index == 1:
                if record["event"] != OPEN_EVENT or not isinstance(record["details"].get("log_id"), str):
                    raise _Bad(line_no, f"record {line_no} is not the audit.open record that starts a log")
                log_id = record["details"]["log_id"]
            if record["event"] == SEAL_EVENT:
                details = record["details"]
                payload = seal_payload(log_id, line_no - 1, prev, str(details.get("sealed_at", "")))
                if details.get("count") != line_no - 1 or details.get("head") != prev:
                    raise _Bad(line_no, f"seal record {line_no} does not describe the records before it")
                if not verifier.valid(payload, str(details.get("sig", ""))):
                    first = last_seal_line + 1
                    raise _Bad(
                        first,
                        f"seal record {line_no} has no valid signature by key {verifier.key_id}: "
                        f"records {first}..{line_no} were rewritten (or the log is not signed by "
                        "this key)",
                    )
                sealed_through, sealed_at, last_seal_line = line_no - 1, payload["ts"], line_no
            prev = record["hash"]
            hashes.append(prev)
            count = line_no
    except _Bad as bad:
        return fail(bad)

    if count == 0:
        return tampered(base + 1, f"audit log {path} is empty")

    # The external seal: the only thing that notices records cut off the end of the file.
    try:
        if seal_bytes is None:
            raise FileNotFoundError(seal_path)
        document = json.loads(seal_bytes)
    except FileNotFoundError:
        if require_seal_file:
            return tampered(count + 1, f"seal file {seal_path} is missing, so truncation cannot be ruled out")
        document = None
    except ValueError as exc:
        return tampered(None, f"seal file {seal_path} is not valid JSON ({exc})")
    if document is not None:
        try:
            payload = seal_payload(
                document["log_id"], int(document["count"]), str(document["head"]), str(document["ts"])
            )
            signature = str(document["sig"])
        except (KeyError, TypeError, ValueError) as exc:
            return tampered(None, f"seal file {seal_path} is malformed ({exc!r})")
        if not verifier.valid(payload, signature):
            return tampered(None, f"seal file {seal_path} has no valid signature by key {verifier.key_id}")
        if payload["log_id"] != log_id:
            return tampered(base + 1, f"seal file {seal_path} belongs to another log ({payload['log_id']})")
        sealed = payload["count"]
        if sealed > count:
            return tampered(
                count + 1,
                f"log ends at record {count} but its seal of {payload['ts']} covers {sealed} "
                f"records: records {count + 1}..{sealed} were removed (truncated)",
            )
        if sealed <= base or hashes[sealed - 1 - base] != payload["head"]:
            return tampered(
                max(sealed, 1),
                f"record {sealed} does not match the hash its seal signed: the log was rewritten",
            )
        if sealed < last_seal_line:
            return tampered(
                sealed + 1,
                f"seal file covers {sealed} records but the log holds a seal at record "
                f"{last_seal_line}: the seal file was rolled back",
            )
        if sealed > sealed_through:
            sealed_through, sealed_at = sealed, payload["ts"]

    if max_seal_age is not None:
        moment = now or datetime.now(UTC)
        if not sealed_at or moment - _parse_time(sealed_at) > max_seal_age:
            return tampered(None, f"newest seal ({sealed_at or 'none'}) is older than {max_seal_age}")
    return VerifyResult(
        True, count, sealed_through, sealed_at, verifier.key_id, first_record=base + 1, head=prev
    )


def _continues(record: dict[str, Any]) -> tuple[int, str] | None:
    """(seq, hash) that the first record of a rotated segment chains to; None for a log's first record."""
    if record.get("event") != OPEN_EVENT or not isinstance(record.get("details"), dict):
        return None
    start = record["details"].get("continues")
    if not isinstance(start, dict):
        return None
    seq, head = start.get("seq"), start.get("hash")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1 or not isinstance(head, str):
        return None
    return seq, head


def verify_segments(
    path: Path,
    verifier: SealVerifier,
    *,
    max_seal_age: timedelta | None = None,
    now: datetime | None = None,
) -> VerifyResult:
    """Verify every segment of the log at ``path`` (``<path>.N`` .. ``<path>``) and that each continues
    the one before it: a removed, replaced or reordered segment in between fails. Segments rotated
    away before the oldest one kept show as ``first_record`` above 1."""
    files = segments(Path(path))
    if not files:
        return verify_log(path, verifier, max_seal_age=max_seal_age, now=now)
    result: VerifyResult | None = None
    first_record = 0
    for number, file in enumerate(files):
        newest = number == len(files) - 1
        checked = verify_log(file, verifier, max_seal_age=max_seal_age if newest else None, now=now)
        if not checked.ok:
            return dataclasses.replace(checked, reason=f"{file.name}: {checked.reason}")
        if result is not None and (checked.first_record != result.records + 1 or not _chains(file, result)):
            return dataclasses.replace(
                checked,
                ok=False,
                first_bad=checked.first_record,
                reason=f"{file.name} does not continue {files[number - 1].name} (records "
                f"{result.first_record}..{result.records}): a segment was removed, replaced or reordered",
            )
        first_record = first_record or checked.first_record
        result = checked
    assert result is not None
    return dataclasses.replace(result, first_record=first_record)


def _chains(file: Path, before: VerifyResult) -> bool:
    with open(file, "rb") as handle:
        first = json.loads(handle.readline())
    return _continues(first) == (before.records, before.head)
