"""A stage's per-step history on disk, so that a job's report is whole after it ended, after a trainer
restart and from a stopped deployment.

The trainer appends one row per step (and one per change of state) of every stage it runs to a CSV
file beside the stage's record, as the statuses reach its board:

    <data dir>/stages/<owner>/<job_id>.steps.csv     (0600 in the records' 0700 directory)

CSV because anyone can open it without Nebula (a spreadsheet, ``pandas.read_csv``, ``csvkit``); the
columns are the ``StageStatus`` fields a report draws (``COLUMNS``), with times in Unix seconds. The
trainer writes it, never the stage process (whose code is the tenant's); a kill may leave the last
line torn, and reading skips any row that does not parse. It goes when the stage's record goes
(``NEBULA_TRAINER_FINISHED_TTL_S`` after the stage ended, or when more than
``NEBULA_TRAINER_MAX_FINISHED`` ended stages are kept); at most ``MAX_ROWS`` rows per stage (about
200 bytes each), after which only changes of state are written.
"""

from __future__ import annotations

import contextlib
import csv
import io
import logging
import os
import threading
import time
from pathlib import Path
from typing import IO, Any

from nebula_common.proto.nebula.v1 import trainer_pb2

log = logging.getLogger(__name__)

SUFFIX = ".steps.csv"
MAX_ROWS = 1_000_000
COUNTERS = (
    "steps_done",
    "epoch",
    "resumed_from_step",
    "checkpoint_step",
    "bytes_sent",
    "bytes_received",
    "raw_bytes_sent",
    "raw_bytes_received",
)
SECONDS = ("step_seconds", "compute_seconds", "wait_seconds")
OPTIONAL = ("loss", "local_loss")
TEXT = ("codec_forward", "codec_backward", "message")
COLUMNS = ("unix_time", "state", *COUNTERS, *OPTIONAL, *SECONDS, *TEXT)


def history_path(record_path: Path) -> Path:
    """The history file beside a stage record (``<job_id>.json``)."""
    return record_path.with_name(record_path.name.removesuffix(".json") + SUFFIX)


def _row(status: trainer_pb2.StageStatus) -> list[str]:
    row = [f"{time.time():.3f}", trainer_pb2.StageState.Name(status.state).removeprefix("STAGE_STATE_")]
    row += [str(getattr(status, name)) for name in COUNTERS]
    row += [repr(getattr(status, name)) if status.HasField(name) else "" for name in OPTIONAL]
    row += [repr(getattr(status, name)) for name in SECONDS]
    row += [getattr(status, name) for name in TEXT]
    return row


class StepHistory:
    """Appends a stage's statuses to its history file: subscribe ``record`` to the stage's board."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._last: tuple[int, int, int] | None = None
        self._rows = 0
        self._file: IO[str] | None = None
        self._writer: Any = None  # the csv module's writer (no public type)

    def follows(self, status: trainer_pb2.StageStatus | None) -> None:
        """The file already ends with ``status`` (a restored stage): a repeat of it is no new row."""
        with self._lock:
            self._last = None if status is None else (status.steps_done, status.epoch, status.state)

    def record(self, status: trainer_pb2.StageStatus) -> None:
        """One status of the board: written when its step, epoch or state is new (never raises)."""
        key = (status.steps_done, status.epoch, status.state)
        with self._lock:
            if key == self._last:
                return
            stepped = self._last is None or key[2] == self._last[2]
            if stepped and self._rows >= MAX_ROWS:
                return
            self._last = key
            try:
                self._open().writerow(_row(status))
                assert self._file is not None
                self._file.flush()
                self._rows += 1
            except (OSError, ValueError) as exc:  # the stage runs on; its report will miss these rows
                log.error("cannot write the step history %s: %s", self.path, exc)

    def _open(self) -> Any:
        if self._file is None:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self._file = os.fdopen(fd, "a", newline="", encoding="utf-8")
            self._writer = csv.writer(self._file)
            if self._file.tell() == 0:
                self._writer.writerow(COLUMNS)
        return self._writer

    def close(self) -> None:
        """The stage ended: its history is durable (fsync) and the file closed."""
        with self._lock:
            if self._file is None:
                return
            with contextlib.suppress(OSError, ValueError):
                self._file.flush()
                os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


def read_history(path: Path, job_id: str, stage: str) -> list[trainer_pb2.StageStatus]:
    """The statuses a history file holds, oldest first (none if there is no file; bad rows skipped)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    statuses = []
    for row in csv.DictReader(io.StringIO(text)):
        try:
            statuses.append(_status(row, job_id, stage))
        except (KeyError, ValueError, TypeError):
            continue  # a torn last line (a kill mid-write) or a damaged row
    return statuses


def _status(row: dict[str, str], job_id: str, stage: str) -> trainer_pb2.StageStatus:
    status = trainer_pb2.StageStatus(
        job_id=job_id, stage=stage, state=trainer_pb2.StageState.Value("STAGE_STATE_" + row["state"])
    )
    for name in COUNTERS:
        setattr(status, name, int(row[name]))
    for name in SECONDS:
        setattr(status, name, float(row[name]))
    for name in OPTIONAL:
        if row[name]:
            setattr(status, name, float(row[name]))
    for name in TEXT:
        if row[name] is None:
            raise ValueError(f"row without {name}")
        setattr(status, name, row[name])
    return status


__all__ = ["COLUMNS", "MAX_ROWS", "StepHistory", "history_path", "read_history"]
