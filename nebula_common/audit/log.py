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
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

from nebula_common.audit.metrics import WRITE_FAILURES
from nebula_common.audit.signing import AuditSigner, canonical_json
from nebula_common.durable import atomic_write

__all__ = [
    "FORMAT_VERSION",
    "GENESIS_PREV",
    "SEAL_EVENT",
    "AuditError",
    "AuditLog",
    "record_hash",
    "seal_path_for",
    "utc_timestamp",
]

FORMAT_VERSION = 1
GENESIS_PREV = "0" * 64
SEAL_EVENT = "audit.seal"
OPEN_EVENT = "audit.open"
OUTCOMES = frozenset({"ok", "failure", "refused"})
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


def seal_path_for(log_path: Path) -> Path:
    """Where the external seal of ``log_path`` lives: same directory, ``.seal`` appended."""
    return log_path.with_name(log_path.name + ".seal")


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
    ) -> None:
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
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
        self._fd = os.open(self.path, flags, 0o640)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise AuditError(f"audit log {self.path} is already open by another process") from None
        try:
            self._seq, self._head, self._log_id = self._resume()
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
            record = self._write(event, outcome, account, job_id, dict(details or {}))
            if event != SEAL_EVENT:
                self._unsealed += 1
                if self._unsealed >= self._seal_every:
                    self._seal_locked()
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
            WRITE_FAILURES.labels(self._service).inc()
            raise AuditError(f"cannot append to audit log {self.path}: {exc}") from exc
        self._seq = record["seq"]
        self._head = record["hash"]
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
                "sig": self._signer.sign(covered),
            },
        )
        with contextlib.suppress(OSError):
            os.fsync(self._fd)
        outer = seal_payload(self._log_id, self._seq, self._head, ts)
        document = {
            **outer,
            "v": FORMAT_VERSION,
            "key_id": self._signer.key_id,
            "sig": self._signer.sign(outer),
        }
        try:
            atomic_write(self.seal_path, canonical_json(document) + b"\n", mode=0o640)
        except OSError as exc:
            raise AuditError(f"cannot write audit seal {self.seal_path}: {exc}") from exc
        self._unsealed = 0
        self._last_seal = time.monotonic()

    def _seal_periodically(self) -> None:
        while not self._stop.wait(min(1.0, self._seal_interval_s)):
            with self._lock:
                if self._closed:
                    return
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
                os.close(self._fd)
        if self._sealer is not threading.current_thread():
            self._sealer.join(timeout=5)

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
