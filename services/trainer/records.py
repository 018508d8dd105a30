"""Stage records: what a trainer keeps on disk so that it can resume its stages after a restart.

A trainer's stages live on threads of its process; ``kill -9`` (or a crash, or the OOM killer) takes
them all, and the supervisor's restart starts a process that knew nothing of them. The peer stage and
the switch wait for a while (a vanished trainer orphans its route instead of failing the peer), so
the restarted trainer only has to remember, per stage, what it needs to start it again at a higher
epoch: the StageSpec, whose authority it acts on (the owner and their token), the epoch it had
reached and whether it had already ended. That is one small file per stage:

    <data dir>/stages/<owner>/<job_id>.json     (directories 0700, files 0600: the token is a secret)

Every write is atomic (temp file + fsync + rename + directory fsync, ``nebula_common.durable``), so
a kill at any moment leaves the previous record or the new one, never a torn one. The epoch is
written *before* the stage opens that epoch (``on_epoch``): a record never lags behind an epoch the
switch has seen, so a restart's ``epoch + 1`` is always higher than anything the route knows.

A stage that ended keeps its record with its final ``StageStatus`` (and loses its spec and token,
which nothing needs any more), so after any number of restarts a client can still see how it ended.
Every record also keeps what ``ListStages`` shows of a stage, running or ended: the job spec's
digest, the steps asked for, the edge, and when the stage was assigned and ended (Unix times;
records written before these fields existed read as empty and 0).
A record that cannot be read or parsed is logged, audited (``stage.record``, outcome failure) and
skipped: one damaged file must never keep a trainer, and every other stage on it, from starting.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from google.protobuf.message import DecodeError

from nebula_common.durable import atomic_write
from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer.history import history_path
from services.trainer.status import TERMINAL_STATES, StatusBoard

log = logging.getLogger(__name__)

RECORDS_DIR = "stages"
FORMAT = 1
_SUFFIX = ".json"


class RecordError(ValueError):
    """A stage record that cannot be used (unreadable, not JSON, a missing or wrong field)."""


class AuditSink(Protocol):
    def append(self, event: str, **fields: Any) -> object: ...


def _safe_name(kind: str, value: str) -> str:
    """A path component from a name the caller does not fully control (owner, job id)."""
    if not value or "/" in value or "\x00" in value or value.startswith("."):
        raise RecordError(f"invalid {kind} {value!r} for a stage record path")
    return value


@dataclass
class StageRecord:
    """One stage as its trainer remembers it (see the module doc); ``path`` is where it lives."""

    owner: str
    job_id: str
    stage: str
    spec: trainer_pb2.StageSpec
    token: str
    epoch: int = 0
    state: int = trainer_pb2.STAGE_STATE_PENDING
    final: trainer_pb2.StageStatus | None = None
    path: Path = field(default=Path(), compare=False)
    spec_digest: str = ""
    steps: int = 0
    edge: str = ""
    started_unix: float = 0.0
    ended_unix: float = 0.0

    @classmethod
    def new(cls, spec: trainer_pb2.StageSpec, token: str, owner: str) -> StageRecord:
        """The record of a stage assigned now (epoch 0, PENDING)."""
        return cls(
            owner,
            spec.job_id,
            spec.stage,
            spec,
            token,
            spec_digest=spec.spec_digest,
            steps=spec.steps,
            edge=spec.edge,
            started_unix=round(time.time(), 3),
        )

    def info(self, latest: trainer_pb2.StageStatus) -> trainer_pb2.StageRecordInfo:
        """What ``ListStages`` shows of this stage, with ``latest`` its newest status.

        A final status is published a moment before the record stores its end (a finish callback):
        in between, the stage ended now, not "never".
        """
        ended = self.ended_unix
        if not ended and latest.state in TERMINAL_STATES:
            ended = round(time.time(), 3)
        return trainer_pb2.StageRecordInfo(
            status=latest,
            owner=self.owner,
            spec_digest=self.spec_digest,
            started_unix=self.started_unix,
            ended_unix=ended,
            steps=self.steps,
            edge=self.edge,
        )

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    def to_json(self) -> bytes:
        body: dict[str, Any] = {
            "format": FORMAT,
            "owner": self.owner,
            "job_id": self.job_id,
            "stage": self.stage,
            "epoch": self.epoch,
            "state": trainer_pb2.StageState.Name(self.state),
            "updated_unix": round(time.time(), 3),
            "spec_digest": self.spec_digest,
            "steps": self.steps,
            "edge": self.edge,
            "started_unix": self.started_unix,
            "ended_unix": self.ended_unix,
        }
        if self.terminal:
            # An ended stage needs neither its spec nor its owner's token: drop the secret with them.
            body["final"] = base64.b64encode(
                (self.final or trainer_pb2.StageStatus()).SerializeToString()
            ).decode()
        else:
            body["spec"] = base64.b64encode(self.spec.SerializeToString()).decode()
            body["token"] = self.token
        return json.dumps(body, indent=1).encode()

    @classmethod
    def from_json(cls, raw: bytes, path: Path) -> StageRecord:
        """Parse a record; ``RecordError`` names what is wrong (never a bare KeyError or DecodeError)."""
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RecordError(f"not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise RecordError("not a JSON object")
        if body.get("format") != FORMAT:
            raise RecordError(f"format {body.get('format')!r}, this trainer reads {FORMAT}")
        for key in ("owner", "job_id", "stage", "state"):
            if not isinstance(body.get(key), str) or not body[key]:
                raise RecordError(f"field {key!r} missing or not a non-empty string")
        epoch = body.get("epoch")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise RecordError(f"field 'epoch' {epoch!r} is not a non-negative integer")
        try:
            state = trainer_pb2.StageState.Value(body["state"])
        except ValueError:
            raise RecordError(f"field 'state' {body['state']!r} is not a stage state") from None
        record = cls(body["owner"], body["job_id"], body["stage"], trainer_pb2.StageSpec(), "", epoch, state)
        record.path = path
        _optional_fields(record, body)
        if record.terminal:
            record.final = _message(body, "final", trainer_pb2.StageStatus)
            return record
        record.spec = _message(body, "spec", trainer_pb2.StageSpec)
        if (record.spec.job_id, record.spec.stage) != (record.job_id, record.stage):
            raise RecordError(
                f"spec is for job {record.spec.job_id!r} stage {record.spec.stage!r}, "
                f"the record for job {record.job_id!r} stage {record.stage!r}"
            )
        token = body.get("token")
        if not isinstance(token, str) or not token:
            raise RecordError("field 'token' missing (a running stage acts with its owner's token)")
        record.token = token
        return record


def _optional_fields(record: StageRecord, body: dict[str, Any]) -> None:
    """The listing fields (absent from records older than them: those keep their defaults)."""
    for key in ("spec_digest", "edge"):
        value = body.get(key, "")
        if not isinstance(value, str):
            raise RecordError(f"field {key!r} {value!r} is not a string")
        setattr(record, key, value)
    steps = body.get("steps", 0)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise RecordError(f"field 'steps' {steps!r} is not a non-negative integer")
    record.steps = steps
    for key in ("started_unix", "ended_unix"):
        value = body.get(key, 0.0)
        if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
            raise RecordError(f"field {key!r} {value!r} is not a non-negative number")
        setattr(record, key, float(value))


def _message(body: dict[str, Any], key: str, kind: type[Any]) -> Any:
    value = body.get(key)
    if not isinstance(value, str):
        raise RecordError(f"field {key!r} missing")
    try:
        return kind.FromString(base64.b64decode(value, validate=True))
    except (binascii.Error, ValueError, DecodeError) as exc:
        raise RecordError(f"field {key!r} is not a base64 {kind.__name__}: {exc}") from None


class StageRecords:
    """The stage records under one trainer data dir: create, update epoch or end, and read all back.

    Writes for one record are serialised by a lock: the epoch hook and the end both run on the stage
    thread, but a restore and a shutdown may write too, and the later state must win.
    """

    def __init__(self, data_dir: Path, audit: AuditSink | None = None) -> None:
        self.root = Path(data_dir) / RECORDS_DIR
        self.audit = audit
        self._lock = threading.Lock()

    def store_end(self, record: StageRecord, board: StatusBoard) -> None:
        """Store the stage's final status in ``record``: a finish callback, on the stage's own thread.

        It runs before the stage thread exits, so a stopping trainer that joins its stages has every
        end on disk; no thread waits per stage for it.
        """
        try:
            self.finish(record, board.latest())
        except OSError as exc:  # the stage's end is in the audit log; only a restart would miss it
            log.error("cannot store the end of stage %s/%s: %s", record.job_id, record.stage, exc)

    def path(self, owner: str, job_id: str) -> Path:
        return self.root / _safe_name("owner", owner) / (_safe_name("job id", job_id) + _SUFFIX)

    def _write(self, record: StageRecord) -> None:
        directory = record.path.parent
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        for made in (self.root, directory):  # mkdir's mode is masked and skipped for existing dirs
            os.chmod(made, 0o700)
        atomic_write(record.path, record.to_json(), mode=0o600)

    def create(self, spec: trainer_pb2.StageSpec, token: str, owner: str) -> StageRecord:
        """Remember a newly assigned stage (epoch 0, PENDING) before its runner starts."""
        record = StageRecord.new(spec, token, owner)
        record.path = self.path(owner, spec.job_id)
        with self._lock:
            self._write(record)
        return record

    def set_epoch(self, record: StageRecord, epoch: int) -> None:
        """The stage is about to open ``epoch``: durable before it does (see the module doc)."""
        state = trainer_pb2.STAGE_STATE_RUNNING if epoch == 0 else trainer_pb2.STAGE_STATE_RECOVERING
        with self._lock:
            if record.terminal or epoch < record.epoch or (epoch, state) == (record.epoch, record.state):
                return
            record.epoch, record.state = epoch, state
            self._write(record)

    def set_token(self, record: StageRecord, token: str) -> None:
        """The stage's job token was renewed: durable before the stage uses it (``job_tokens``)."""
        with self._lock:
            if record.terminal:
                return
            record.token = token
            self._write(record)

    def finish(self, record: StageRecord, final: trainer_pb2.StageStatus) -> None:
        """The stage ended: keep only how (its final status), for watchers after any restart."""
        with self._lock:
            record.state = final.state
            record.final = final
            record.token = ""
            record.ended_unix = record.ended_unix or round(time.time(), 3)
            self._write(record)

    def remove(self, owner: str, job_id: str) -> None:
        """Forget an ended stage for good (the trainer's retention of ended stages let it go)."""
        with self._lock:
            try:
                path = self.path(owner, job_id)
                path.unlink(missing_ok=True)
                history_path(path).unlink(missing_ok=True)
            except (OSError, RecordError) as exc:  # a record left behind only shows an old end again
                log.error("cannot remove the record of %s/%s: %s", owner, job_id, exc)

    def _files(self) -> Iterator[Path]:
        if not self.root.is_dir():
            return
        for owner_dir in sorted(self.root.iterdir()):
            if owner_dir.is_dir() and not owner_dir.name.startswith("."):
                # A write cut short by a kill leaves its temp file (the record itself is whole):
                # nothing else writes here while the trainer starts, so they can go.
                for stale in owner_dir.glob(".*.tmp"):
                    stale.unlink(missing_ok=True)
                yield from sorted(
                    p for p in owner_dir.iterdir() if p.name.endswith(_SUFFIX) and not p.name.startswith(".")
                )

    def load_all(self) -> list[StageRecord]:
        """Every readable record; a damaged one is logged, audited and skipped (see the module doc)."""
        records: list[StageRecord] = []
        for path in self._files():
            try:
                if path.is_symlink() or not path.is_file():
                    raise RecordError("not a regular file")
                record = StageRecord.from_json(path.read_bytes(), path)
                if record.owner != path.parent.name or path.name != record.job_id + _SUFFIX:
                    raise RecordError(
                        f"names owner {record.owner!r} job {record.job_id!r}, but lies at {path.parent.name}/"
                        f"{path.name}"
                    )
            except (OSError, RecordError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                self._skipped(path, reason)
                continue
            records.append(record)
        return records

    def _skipped(self, path: Path, reason: str) -> None:
        log.error("stage record skipped: %s: %s", path, reason, extra={"fields": {"path": str(path)}})
        if self.audit is None:
            return
        try:
            self.audit.append(
                "stage.record",
                outcome="failure",
                account=path.parent.name,
                job_id=path.name.removesuffix(_SUFFIX),
                details={"path": str(path.relative_to(self.root)), "reason": reason},
            )
        except Exception:  # an audit failure must not stop the restore of every other stage
            log.exception("cannot audit a skipped stage record")


class FinishedStage:
    """A stage that ended before this trainer (re)started: only its final status, for ``WatchStage``.

    It stands where a runner would (``TrainerServicer.runners``), so a watcher, a cancel and a
    shutdown treat it like any ended stage: its board holds the final status, nothing runs.
    """

    def __init__(
        self, final: trainer_pb2.StageStatus, owner: str, history: list[trainer_pb2.StageStatus] | None = None
    ) -> None:
        self.owner = owner
        self.spec = trainer_pb2.StageSpec(job_id=final.job_id, stage=final.stage)
        self.board = StatusBoard(final.job_id, final.stage)
        for status in history or ():  # its steps, from its history file (``history``)
            if status.state not in TERMINAL_STATES:
                self.board.publish(status)
        fields = {f.name: value for f, value in final.ListFields()}
        self.board.update(**fields)

    def start(self) -> None:
        """Nothing to run: the stage ended before this process started."""

    def cancel(self) -> None:
        """Cancelling an ended stage changes nothing (as for a runner that has ended)."""

    def join(self, timeout: float | None = None) -> None:
        """Nothing runs, so nothing to wait for."""

    def release(self) -> None:
        """Holds nothing but its status."""


__all__ = ["RECORDS_DIR", "FinishedStage", "RecordError", "StageRecord", "StageRecords"]
