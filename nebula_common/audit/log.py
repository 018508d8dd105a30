"""An append-only, hash-chained, periodically signed audit log: one JSON record per line.

The record format is :mod:`nebula_common.audit.records`'s.

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
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from nebula_common.audit.metrics import WRITABLE, WRITE_FAILURES
from nebula_common.audit.records import (
    FORMAT_VERSION,
    OPEN_EVENT,
    OUTCOMES,
    RESUMED_EVENT,
    SEAL_EVENT,
    AuditError,
    record_hash,
    seal_payload,
    utc_timestamp,
)
from nebula_common.audit.resume import read_head, unsigned_lines
from nebula_common.audit.segments import seal_path_for, segment_path, shift_segments
from nebula_common.audit.signing import AuditSigner, canonical_json
from nebula_common.durable import atomic_write

__all__ = ["SEAL_INTERVAL_S", "SEGMENTS_KEPT", "SEGMENT_BYTES", "AuditLog"]

SEGMENT_BYTES = 64 << 20
"""Size at which the log file is sealed and rotated."""
SEGMENTS_KEPT = 8
"""Rotated segments kept beside the current file (``<log>.1`` newest .. ``<log>.8`` oldest)."""
SEAL_INTERVAL_S = 5.0
"""The longest a record stays unsealed while events arrive (a seal also every ``seal_every`` records)."""
log = logging.getLogger(__name__)


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
            self._seq, self._head, self._log_id = read_head(self.path)  # the chain continues
            # A signer of its own process (``remote_signer``) is sent the records since its last head.
            remote = getattr(signer, "needs_records", False)
            self._pending: list[bytes] | None = (
                unsigned_lines(self.path, signer.position, self._seq, self._head, self._log_id)  # type: ignore[attr-defined]
                if remote
                else None
            )
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
