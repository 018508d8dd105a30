"""An append-only, hash-chained, periodically signed audit log: one JSON record per line.

Record format (every field always present)::

    {"v": 1, "seq": 7, "ts": "2025-01-01T12:00:00.123456Z", "service": "switch", "cluster": "a",
     "event": "link.refused", "outcome": "refused", "account": "", "job_id": "",
     "details": {...}, "prev": "<hash of record 6>", "hash": "<sha256 of this record without 'hash'>"}

``seq`` counts from 1 with no gaps; record 1 (``audit.open`` of a new file) has ``prev`` =
64 zeros and carries the log's random ``log_id``. ``hash`` is SHA-256 over the canonical JSON of
the record without ``hash``, so editing any field breaks it and deleting, inserting or reordering
lines breaks ``seq`` and ``prev``.

Sealing: every ``seal_every`` records or ``seal_interval_s`` seconds (and on close) the writer
appends an ``audit.seal`` record whose ``details.sig`` signs ``{log_id, count, head, ts}`` for
the records before it, then atomically replaces ``<log>.seal`` (a file *outside* the log) with a
signature over the log up to and including that seal record. What that guarantees is written down
in :mod:`nebula_common.audit.verify`.

A single process owns a log (an exclusive ``flock``); every record is written with one
``write`` on an ``O_APPEND`` descriptor so a crash can at worst leave the last line torn, never
interleave two records.

Rotation: once the file holds ``SEGMENT_BYTES`` the writer seals it and renames it (with its seal) to
``<log>.1``, older segments moving up to ``<log>.<SEGMENTS_KEPT>`` and the oldest dropped; the new file
starts with an ``audit.open`` record whose ``details.continues`` names the seq and hash it chains to, so
seq and hash chain run on across segments (``verify_segments``). A service's log therefore takes at
most ``(SEGMENTS_KEPT + 1) * SEGMENT_BYTES`` (576 MiB) plus one seal file per segment.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

from nebula_common.audit.metrics import WRITABLE, WRITE_FAILURES
from nebula_common.audit.segments import seal_path_for, segment_path, segments, shift_segments
from nebula_common.audit.signing import AuditSigner, canonical_json
from nebula_common.durable import atomic_write

__all__ = [
    "FORMAT_VERSION",
    "GENESIS_PREV",
    "SEAL_EVENT",
    "SEGMENTS_KEPT",
    "SEGMENT_BYTES",
    "AuditError",
    "AuditLog",
    "record_hash",
    "seal_path_for",
    "segment_path",
    "segments",
    "utc_timestamp",
]

FORMAT_VERSION = 1
GENESIS_PREV = "0" * 64
SEAL_EVENT = "audit.seal"
OPEN_EVENT = "audit.open"
OUTCOMES = frozenset({"ok", "failure", "refused"})
SEGMENT_BYTES = 64 << 20
"""Size at which the log file is sealed and rotated."""
SEGMENTS_KEPT = 8
"""Rotated segments kept beside the current file (``<log>.1`` newest .. ``<log>.8`` oldest)."""
RESUMED_EVENT = "audit.resumed"
"""First record after writes failed (a full disk): how many failed and since when."""
SEAL_INTERVAL_S = 5.0
"""The longest a record stays unsealed while events arrive (a seal also every ``seal_every`` records)."""
log = logging.getLogger(__name__)


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


class AuditLog:
    """Writer of one service's audit log. Thread-safe; appends are synchronous (a few µs to ms)."""

    def __init__(
        self,
        path: Path,
        signer: AuditSigner,
        *,
        service: str,
        cluster: str,
        seal_every: int = 64,
        seal_interval_s: float = SEAL_INTERVAL_S,
        fsync_each: bool = True,
        segment_bytes: int = SEGMENT_BYTES,
        segments_kept: int = SEGMENTS_KEPT,
    ) -> None:
        if segment_bytes < 1 or segments_kept < 1:
            raise ValueError(
                f"segment_bytes and segments_kept must be positive, got {segment_bytes}, {segments_kept}"
            )
        self._segment_bytes = segment_bytes
        self._segments_kept = segments_kept
        self._failed_writes = 0  # since the last record written (a full disk, an I/O error)
        self._failing_since = ""
        self._listeners: list[Callable[[bool], None]] = []
        WRITABLE.labels(service).set(1)
        if seal_every < 1:
            raise ValueError(f"seal_every must be at least 1, got {seal_every}")
        if seal_interval_s <= 0:
            raise ValueError(f"seal_interval_s must be positive, got {seal_interval_s}")
        self.path = Path(path)
        self.seal_path = seal_path_for(self.path)
        self._signer = signer
        self._service = service
        self._cluster = cluster
        self._seal_every = seal_every
        self._seal_interval_s = seal_interval_s
        self._fsync_each = fsync_each
        self._lock = threading.Lock()
        self._closed = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = self._open_file()
        try:
            self._seq, self._head, self._log_id = self._resume()
            # A signer of its own process (``remote_signer``) is sent the records since its last head.
            remote = getattr(signer, "needs_records", False)
            self._pending: list[bytes] | None = self._unsigned() if remote else None
        except BaseException:
            os.close(self._fd)
            raise
        self._unsealed = 0
        self._last_seal = time.monotonic()
        self._stop = threading.Event()
        if self._seq == 0:
            self._log_id = secrets.token_hex(16)
            self.append(
                OPEN_EVENT, details={"log_id": self._log_id, "key_id": signer.key_id, "resumed": False}
            )
        else:
            self.append(
                OPEN_EVENT, details={"log_id": self._log_id, "key_id": signer.key_id, "resumed": True}
            )
        self._sealer = threading.Thread(target=self._seal_periodically, name="audit-sealer", daemon=True)
        self._sealer.start()

    def _open_file(self) -> int:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(self.path, flags, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise AuditError(f"audit log {self.path} is already open by another process") from None
        self._size = os.fstat(fd).st_size
        return fd

    def _rotate_locked(self) -> None:
        """Seal this segment, move it (and older ones) up, and start the next one chained to it."""
        self._seal_locked()
        try:
            self._move_segments_up()
        except OSError as exc:
            WRITE_FAILURES.labels(self._service).inc()
            raise AuditError(f"cannot rotate audit log {self.path}: {exc}") from exc
        self._start_segment()

    def _move_segments_up(self) -> None:
        fd, self._fd = self._fd, -1  # a failure below leaves no descriptor a later write could reuse
        os.close(fd)
        shift_segments(self.path, self._segments_kept)
        self._fd = self._open_file()

    def _start_segment(self) -> None:
        continues = {"seq": self._seq, "hash": self._head, "segment": segment_path(self.path, 1).name}
        self._write(
            OPEN_EVENT,
            "ok",
            "",
            "",
            {"log_id": self._log_id, "key_id": self._signer.key_id, "resumed": True, "continues": continues},
        )
        self._unsealed = 1
        self._seal_locked()  # the new file has its seal file from its first record on

    # ------------------------------------------------------------------ reading back on start
    def _resume(self) -> tuple[int, str, str]:
        """(last seq, last hash, log id) of an existing log, so the chain continues across restarts.

        Only the first and last lines are read (verification of everything is ``nebula audit
        verify``'s job); a torn or unparseable last line stops the service rather than chaining
        new records onto something nobody can check.
        """
        with open(self.path, "rb") as handle:
            first = handle.readline()
            if not first:
                return 0, GENESIS_PREV, ""
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - (1 << 20)))
            tail = handle.read().splitlines()
        try:
            genesis = json.loads(first)
            last = json.loads(tail[-1])
            log_id = str(genesis["details"]["log_id"])
            return int(last["seq"]), str(last["hash"]), log_id
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise AuditError(
                f"audit log {self.path} ends in an unreadable record ({exc!r}); "
                f"run `nebula audit verify {self.path}` and move the file aside before restarting"
            ) from exc

    def _unsigned(self) -> list[bytes]:
        """The lines after the signer's last signed head (``RemoteSigner.position``), from this file.

        A rotation seals before it moves the file, so what the signer has not signed is in the current
        file. A signer that has signed nothing yet starts from this log's last record (a log sealed by a
        key of its own until now). A log that does not reach the signer's head, or is another log,
        stops the service here with the reason, rather than at its first seal.
        """
        known = self._signer.position  # type: ignore[attr-defined]
        if not known.log_id:
            return self._lines_after(self._seq - 1) if self._seq else []
        if known.log_id != self._log_id or known.count > self._seq:
            raise AuditError(
                f"audit log {self.path} is log {self._log_id or '(new)'} with {self._seq} records, but its "
                f"signer sealed log {known.log_id} up to record {known.count}: the log was cut short or "
                f"replaced (run `nebula audit verify {self.path}`)"
            )
        if known.count == self._seq:
            if self._head != known.head:
                raise AuditError(f"audit log {self.path} ends at record {self._seq}, not at the sealed head")
            return []
        lines = self._lines_after(known.count)
        first = json.loads(lines[0]) if lines else {}
        if first.get("seq") != known.count + 1 or first.get("prev") != known.head:
            raise AuditError(
                f"audit log {self.path} no longer holds the records after {known.count} that its signer "
                f"sealed (run `nebula audit verify {self.path}`)"
            )
        return lines

    def _lines_after(self, count: int) -> list[bytes]:
        """This file's record lines with ``seq`` above ``count``, oldest first (the tail read first)."""
        with open(self.path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            for start in (max(0, size - (4 << 20)), 0):
                handle.seek(start)
                lines = handle.read().split(b"\n")
                if start:
                    lines = lines[1:]  # the first may be a line's end
                found = [line for line in lines if line and int(json.loads(line)["seq"]) > count]
                if not start or len(found) < len(lines) - 1:  # the tail reached back far enough
                    return found
        return found

    # ------------------------------------------------------------------ writing
    @property
    def log_id(self) -> str:
        return self._log_id

    @property
    def key_id(self) -> str:
        return self._signer.key_id

    def public_pem(self) -> bytes:
        """PEM of the public key that verifies this log's seals."""
        return self._signer.public_pem()

    def watch(self, listener: Callable[[bool], None]) -> None:
        """Call ``listener(writable)`` now and whenever writes start failing (False) or work again (True).

        Called with the log's lock held, from whichever thread appended: schedule, do not block.
        """
        self._listeners.append(listener)
        listener(self._failed_writes == 0)

    @property
    def failing(self) -> tuple[int, str]:
        """(writes failed since the last record written, when the first of them failed); (0, "") if none."""
        return self._failed_writes, self._failing_since

    def _notify(self, writable: bool) -> None:
        WRITABLE.labels(self._service).set(1 if writable else 0)
        for listener in self._listeners:
            try:
                listener(writable)
            except Exception:  # a listener must not turn a written record into a failed operation
                log.exception("audit state listener failed")

    def _resume_writing_locked(self) -> None:
        """After failed writes: record how many failed (``audit.resumed``), then accept records again."""
        failed, since = self._failed_writes, self._failing_since
        self._write(RESUMED_EVENT, "ok", "", "", {"failed_writes": failed, "failing_since": since})
        self._unsealed += 1
        self._failed_writes, self._failing_since = 0, ""
        log.warning("audit log writable again after %d failed writes since %s", failed, since)
        self._notify(True)

    @property
    def records(self) -> int:
        """Number of records written so far (the last ``seq``)."""
        return self._seq

    def head(self) -> tuple[str, int, str]:
        """(log id, records so far, hash of the last record): what a witness records of this log."""
        with self._lock:
            return self._log_id, self._seq, self._head

    def append(
        self,
        event: str,
        *,
        outcome: str = "ok",
        account: str = "",
        job_id: str = "",
        details: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Append one record and return it; raises ``AuditError`` if it could not be written.

        Callers treat a failed audit write as a failed operation: an event that cannot be recorded
        must not silently happen.
        """
        if not event or not isinstance(event, str):
            raise ValueError("audit event name must be a non-empty string")
        if outcome not in OUTCOMES:
            raise ValueError(f"audit outcome must be one of {sorted(OUTCOMES)}, got {outcome!r}")
        with self._lock:
            if self._closed:
                raise AuditError(f"audit log {self.path} is closed")
            if self._failed_writes:
                self._resume_writing_locked()
            record = self._write(event, outcome, account, job_id, dict(details or {}))
            if event != SEAL_EVENT:
                self._unsealed += 1
                if self._unsealed >= self._seal_every:
                    self._seal_locked()
                if self._size >= self._segment_bytes:
                    self._rotate_locked()
        return record

    def _write(
        self, event: str, outcome: str, account: str, job_id: str, details: dict[str, Any]
    ) -> dict[str, Any]:
        record: dict[str, Any] = {
            "v": FORMAT_VERSION,
            "seq": self._seq + 1,
            "ts": utc_timestamp(),
            "service": self._service,
            "cluster": self._cluster,
            "event": event,
            "outcome": outcome,
            "account": account,
            "job_id": job_id,
            "details": details,
            "prev": self._head,
        }
        record["hash"] = record_hash(record)
        line = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
        data = (line + "\n").encode()
        try:
            written = os.write(self._fd, data)
            if written != len(data):
                raise OSError(f"short write ({written} of {len(data)} bytes)")
            if self._fsync_each:
                os.fsync(self._fd)
        except OSError as exc:
            # A full disk may take part of the line: cut it off, so the file never holds a torn record
            # that the next one would chain after.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
            WRITE_FAILURES.labels(self._service).inc()
            self._failed_writes += 1
            if self._failed_writes == 1:
                self._failing_since = utc_timestamp()
                log.error("audit log %s cannot be written: %s", self.path, exc)
                self._notify(False)
            raise AuditError(f"cannot append to audit log {self.path}: {exc}") from exc
        self._seq = record["seq"]
        self._head = record["hash"]
        self._size += len(data)
        if self._pending is not None:
            self._pending.append(data[:-1])
        return record

    def seal(self) -> None:
        """Seal now (if anything is unsealed): in-log seal record, then the external seal file."""
        with self._lock:
            if not self._closed:
                self._seal_locked()

    def _seal_locked(self) -> None:
        if self._unsealed == 0:
            return
        ts = utc_timestamp()
        covered = seal_payload(self._log_id, self._seq, self._head, ts)
        self._write(
            SEAL_EVENT,
            "ok",
            "",
            "",
            {
                "count": self._seq,
                "head": self._head,
                "sealed_at": ts,
                "key_id": self._signer.key_id,
                "sig": self._sign(covered),
            },
        )
        with contextlib.suppress(OSError):
            os.fsync(self._fd)
        outer = seal_payload(self._log_id, self._seq, self._head, ts)
        document = {
            **outer,
            "v": FORMAT_VERSION,
            "key_id": self._signer.key_id,
            "sig": self._sign(outer),
        }
        try:
            atomic_write(self.seal_path, canonical_json(document) + b"\n", mode=0o640)
        except OSError as exc:
            raise AuditError(f"cannot write audit seal {self.seal_path}: {exc}") from exc
        self._unsealed = 0
        self._last_seal = time.monotonic()

    def _sign(self, payload: dict[str, Any]) -> str:
        """The signature of ``payload``; a signer of its own process also gets the records since its last."""
        if self._pending is None:
            return self._signer.sign(payload)
        signature = self._signer.sign(payload, self._pending)  # type: ignore[call-arg]
        self._pending = []
        return signature

    def _seal_periodically(self) -> None:
        while not self._stop.wait(min(1.0, self._seal_interval_s)):
            with self._lock:
                if self._closed:
                    return
                if self._failed_writes:  # room again? say so without waiting for the next operation
                    with contextlib.suppress(AuditError):
                        self._resume_writing_locked()
                if self._unsealed and time.monotonic() - self._last_seal >= self._seal_interval_s:
                    try:
                        self._seal_locked()
                    except Exception:  # the next append reports a persistent failure to its caller
                        log.exception(
                            "periodic audit seal failed", extra={"fields": {"path": str(self.path)}}
                        )

    def close(self) -> None:
        """Seal what is unsealed and release the file; later appends raise ``AuditError``."""
        self._stop.set()
        with self._lock:
            if self._closed:
                return
            try:
                self._seal_locked()
            finally:
                self._closed = True
                if self._fd >= 0:
                    os.close(self._fd)
                closing = getattr(self._signer, "close", None)  # a signer process's channel
                if closing is not None:
                    closing()
        if self._sealer is not threading.current_thread():
            self._sealer.join(timeout=5)

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
