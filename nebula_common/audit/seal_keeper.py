"""The signer's side of one audit log: its seal key, and the head it last signed.

A ``SealKeeper`` signs a seal only for a head that the records it is shown lead to from the last head it
signed for the same log: each record's ``seq`` is one more than the one before, its ``prev`` is that
record's hash, and its ``hash`` is recomputed here (``record_hash``, as ``nebula audit verify`` does).
So a service that can ask for seals but never reads the key (``services/signer``) can append records,
true or not, but can never get a seal over a history that leaves out or changes what was sealed
before: the chain would have to pass through the last signed head, whose hash commits to every record
up to it. The position is kept on disk (``seal-state.json``, written before the signature is returned),
so a restarted signer holds the service to the same chain.

The first request of a keeper without a position starts the chain wherever the records start (a log
that was sealed by a key of its own before): trust on first use, stated in ``docs/accounts-and-audit.md``.
A log that should really start over (an operator moved the old one aside) needs its keeper's state
moved aside too: a new ``log_id`` is refused while a position for another one exists.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nebula_common.audit.records import GENESIS_PREV, OPEN_EVENT, record_hash, seal_payload
from nebula_common.audit.signing import AuditSigner, canonical_json
from nebula_common.durable import atomic_write

__all__ = ["MAX_RECORDS", "MAX_RECORD_BYTES", "STATE_NAME", "SealKeeper", "SealPosition", "SealRefused"]

STATE_NAME = "seal-state.json"
MAX_RECORD_BYTES = 1 << 20
"""Largest record line accepted (an audit record is a few hundred bytes)."""
MAX_RECORDS = 100_000
"""Most records one request may carry (a service whose signer was away for a while catches up)."""


class SealRefused(Exception):
    """The seal cannot be signed; ``malformed`` when a record or the request itself is not well formed."""

    def __init__(self, message: str, *, malformed: bool = False) -> None:
        super().__init__(message)
        self.malformed = malformed


@dataclass(frozen=True)
class SealPosition:
    """The last head signed for a log: which log, how many records, the hash of the last one."""

    log_id: str = ""
    count: int = 0
    head: str = ""


def _parse(raw: bytes, index: int) -> dict[str, Any]:
    if len(raw) > MAX_RECORD_BYTES:
        raise SealRefused(f"record {index} is {len(raw)} bytes (at most {MAX_RECORD_BYTES})", malformed=True)
    try:
        record = json.loads(raw)
    except ValueError as exc:
        raise SealRefused(f"record {index} is not JSON: {exc}", malformed=True) from None
    if (
        not isinstance(record, dict)
        or not isinstance(record.get("seq"), int)
        or not isinstance(record.get("prev"), str)
        or not isinstance(record.get("hash"), str)
    ):
        raise SealRefused(f"record {index} lacks an integer seq or a prev or hash string", malformed=True)
    return record


class SealKeeper:
    """One log's seal key and signed position, in ``directory`` (which only the signer can read)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.signer = AuditSigner.load_or_create(self.directory)
        self._state_path = self.directory / STATE_NAME
        self._lock = threading.Lock()
        self._position = self._load()

    def _load(self) -> SealPosition:
        try:
            document = json.loads(self._state_path.read_bytes())
        except FileNotFoundError:
            return SealPosition()
        except ValueError as exc:
            raise SealRefused(f"{self._state_path} is not JSON ({exc}); the signer cannot continue") from None
        return SealPosition(str(document["log_id"]), int(document["count"]), str(document["head"]))

    @property
    def position(self) -> SealPosition:
        with self._lock:
            return self._position

    def sign(self, log_id: str, count: int, head: str, ts: str, records: Sequence[bytes]) -> str:
        """The signature of ``seal_payload(log_id, count, head, ts)`` if ``records`` lead there from the
        last signed head (``SealRefused`` saying why not); the new position is on disk first."""
        if not log_id or count < 1 or len(head) != 64:
            raise SealRefused("a seal names a log, a count of at least 1 and a 64-hex head", malformed=True)
        if len(records) > MAX_RECORDS:
            raise SealRefused(f"{len(records)} records in one request, at most {MAX_RECORDS}", malformed=True)
        with self._lock:
            self._check(log_id, count, head, records)
            signature = self.signer.sign(seal_payload(log_id, count, head, ts))
            reached = SealPosition(log_id, count, head)
            if reached != self._position:
                atomic_write(
                    self._state_path,
                    canonical_json({"log_id": log_id, "count": count, "head": head}) + b"\n",
                    mode=0o600,
                )
                self._position = reached
            return signature

    def _check(self, log_id: str, count: int, head: str, records: Sequence[bytes]) -> None:
        known = self._position
        if known.log_id and log_id != known.log_id:
            raise SealRefused(
                f"log {known.log_id} was sealed up to record {known.count}; another log ({log_id}) cannot "
                "take its place (move the signer's seal-state.json aside to start a new log on purpose)"
            )
        if known.log_id:
            seq, prev = known.count, known.head
        elif records:  # the first seal this keeper makes: the chain starts where the records do
            first = _parse(records[0], 0)
            seq, prev = first["seq"] - 1, first["prev"]
            if seq == 0 and prev != GENESIS_PREV:
                raise SealRefused("record 1 must chain to the genesis hash")
        else:
            raise SealRefused("no signed head yet and no records to start from")
        for index, raw in enumerate(records):
            record = _parse(raw, index)
            if known.log_id and record["seq"] <= known.count:
                # Sealed already (a retry whose answer was lost): only the last sealed record must match.
                if record["seq"] == known.count and (
                    record["hash"] != known.head or record_hash(record) != known.head
                ):
                    raise SealRefused(f"record {record['seq']} is not the record sealed last")
                continue
            if record["seq"] != seq + 1 or record["prev"] != prev:
                raise SealRefused(
                    f"record {index} (seq {record['seq']}) does not follow record {seq} "
                    f"({prev[:12]}...): the log no longer extends what was sealed"
                )
            if record_hash(record) != record["hash"]:
                raise SealRefused(f"record {index} (seq {record['seq']}) does not hash to its hash field")
            details = record.get("details")
            opens = record.get("event") == OPEN_EVENT and isinstance(details, dict)
            if opens and details.get("log_id") != log_id:
                raise SealRefused(f"record {record['seq']} opens log {details.get('log_id')!r}, not {log_id}")
            seq, prev = record["seq"], record["hash"]
        if seq != count or prev != head:
            raise SealRefused(
                f"the records end at record {seq} ({prev[:12]}...), not at the head to seal "
                f"(record {count}, {head[:12]}...)"
            )
