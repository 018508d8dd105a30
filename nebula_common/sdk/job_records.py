"""A job as one object: its stages' records from every cluster, merged into what a person asks about.

Each cluster's trainer remembers only its own stage (``Trainer/ListStages``: owner, spec digest,
start and end, latest status), and answers only the stage's owner and that cluster's admins. A
job is the stages of one id across the clusters: this module asks each cluster with that
cluster's own session, and merges. Nothing here is stored: the trainers' records are the truth,
and they survive restarts of every service.

How a job ended is decided from its stages: SUCCEEDED when every stage did, CANCELLED when any
stage was cancelled (a cancel reaches one stage first and the other through its edge), FAILED
otherwise; while any stage has not ended the job is RUNNING (or RECOVERING / PENDING).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from nebula_common.errors import NebulaError
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.client import ClusterSession, _raise_for
from services.trainer.history import history_path, read_history
from services.trainer.records import RECORDS_DIR, RecordError, StageRecord, StageRecords

TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
CANCEL_WAIT_S = 60.0


class JobNotFoundError(NebulaError):
    """No cluster shows this job to the caller (it does not exist, was forgotten, or is another's)."""


def _state(status: trainer_pb2.StageStatus) -> str:
    return trainer_pb2.StageState.Name(status.state).removeprefix("STAGE_STATE_")


@dataclass(frozen=True)
class StageView:
    """One stage as its cluster's trainer reports it."""

    cluster: str
    stage: str
    owner: str
    state: str
    message: str
    steps_done: int
    steps: int
    loss: float | None
    step_seconds: float
    bytes_sent: int
    bytes_received: int
    raw_bytes_sent: int
    raw_bytes_received: int
    codec_forward: str
    codec_backward: str
    codec_choice: str
    spec_digest: str
    started_unix: float
    ended_unix: float
    edge: str
    epoch: int
    checkpoint_step: int

    @classmethod
    def from_info(cls, cluster: str, info: trainer_pb2.StageRecordInfo) -> StageView:
        status = info.status
        return cls(
            cluster=cluster,
            stage=status.stage,
            owner=info.owner,
            state=_state(status),
            message=status.message,
            steps_done=status.steps_done,
            steps=info.steps,
            loss=status.loss if status.HasField("loss") else None,
            step_seconds=status.step_seconds,
            bytes_sent=status.bytes_sent,
            bytes_received=status.bytes_received,
            raw_bytes_sent=status.raw_bytes_sent,
            raw_bytes_received=status.raw_bytes_received,
            codec_forward=status.codec_forward,
            codec_backward=status.codec_backward,
            codec_choice=status.codec_choice,
            spec_digest=info.spec_digest,
            started_unix=info.started_unix,
            ended_unix=info.ended_unix,
            edge=info.edge,
            epoch=status.epoch,
            checkpoint_step=status.checkpoint_step,
        )

    @property
    def ended(self) -> bool:
        return self.state in TERMINAL

    @property
    def upstream(self) -> bool:
        """The stage that sends activations (the first stage named in its edge ``a->b``)."""
        return self.edge.split("->")[0] == self.stage if "->" in self.edge else False

    def to_json(self) -> dict[str, Any]:
        body = {name: getattr(self, name) for name in self.__dataclass_fields__}
        body["codec_choice"] = _parse_json(self.codec_choice)
        return body


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text) if text else None
    except ValueError:
        return text


@dataclass
class JobRecord:
    """One job across clusters: its stages (upstream first) and what they add up to."""

    job_id: str
    stages: list[StageView] = field(default_factory=list)

    def _ordered(self) -> list[StageView]:
        """Upstream first; a chain's stages in chain order (each non-first stage's ``edge`` names the
        stage above it), any stage off the chain after them."""
        ordered = sorted(self.stages, key=lambda s: (not s.upstream, s.started_unix, s.stage))
        if not ordered or not ordered[0].upstream:
            return ordered
        chain = [ordered[0]]
        rest = ordered[1:]
        while True:
            below = next((s for s in rest if s.edge.split("->")[0] == chain[-1].stage), None)
            if below is None:
                return chain + rest
            chain.append(below)
            rest.remove(below)

    @property
    def upstream(self) -> StageView | None:
        return next((s for s in self.stages if s.upstream), None)

    @property
    def downstream(self) -> StageView | None:
        """The loss-owning stage: the last of a chain (the only one below the upstream of two)."""
        below = [s for s in self._ordered() if not s.upstream]
        return below[-1] if below else None

    @property
    def state(self) -> str:
        states = {s.state for s in self.stages}
        if not states:
            return "UNKNOWN"
        if not states <= set(TERMINAL):
            for waiting in ("RECOVERING", "RUNNING", "PENDING"):
                if waiting in states:
                    return waiting
            return "RUNNING"
        if states == {"SUCCEEDED"}:
            return "SUCCEEDED"
        return "CANCELLED" if "CANCELLED" in states else "FAILED"

    @property
    def ended(self) -> bool:
        return bool(self.stages) and all(s.ended for s in self.stages)

    @property
    def owners(self) -> dict[str, str]:
        """Cluster -> the account that owns the job's stage there."""
        return {s.cluster: s.owner for s in self._ordered()}

    @property
    def clusters(self) -> dict[str, str]:
        """Stage -> cluster, upstream first."""
        return {s.stage: s.cluster for s in self._ordered()}

    @property
    def steps_done(self) -> int:
        """Steps every stage has completed (the slowest stage's count)."""
        return min((s.steps_done for s in self.stages), default=0)

    @property
    def steps(self) -> int:
        return max((s.steps for s in self.stages), default=0)

    @property
    def loss(self) -> float | None:
        """The loss of the last step, from the stage that owns the loss."""
        return next((s.loss for s in self._ordered()[::-1] if s.loss is not None), None)

    @property
    def started_unix(self) -> float:
        return min((s.started_unix for s in self.stages if s.started_unix), default=0.0)

    @property
    def ended_unix(self) -> float | None:
        return max((s.ended_unix for s in self.stages), default=None) if self.ended else None

    @property
    def spec_digest(self) -> str:
        """The spec digest every stage agrees on ("" if none was sent; "MISMATCH:…" if they differ)."""
        digests = sorted({s.spec_digest for s in self.stages})
        return digests[0] if len(digests) == 1 else "MISMATCH:" + ",".join(digests)

    def traffic(self) -> dict[str, dict[str, Any]]:
        """Encoded and raw bytes each way, as the stages' edges counted them (per job by construction).

        forward = what the upstream stage sent; backward = what the downstream stage sent.
        """
        result: dict[str, dict[str, Any]] = {}
        for direction, stage in (("forward", self.upstream), ("backward", self.downstream)):
            if stage is None:
                continue
            result[direction] = {
                "bytes": stage.bytes_sent,
                "raw_bytes": stage.raw_bytes_sent,
                "compression_ratio": stage.raw_bytes_sent / stage.bytes_sent if stage.bytes_sent else 0.0,
                "codec": stage.codec_forward if direction == "forward" else stage.codec_backward,
            }
        return result

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "state": self.state,
            "owners": self.owners,
            "clusters": self.clusters,
            "spec_digest": self.spec_digest,
            "steps_done": self.steps_done,
            "steps": self.steps,
            "loss": self.loss,
            "started_unix": self.started_unix,
            "ended_unix": self.ended_unix,
            "traffic": self.traffic(),
            "stages": [s.to_json() for s in self._ordered()],
        }


def list_stage_infos(session: ClusterSession, job_id: str = "") -> list[trainer_pb2.StageRecordInfo]:
    """The stages this session's account may see on its cluster (one job's if ``job_id``)."""
    try:
        response = session.trainer.ListStages(
            trainer_pb2.ListStagesRequest(job_id=job_id), metadata=session.metadata, timeout=10
        )
    except grpc.RpcError as exc:
        _raise_for(exc, f"listing jobs on cluster {session.endpoints.cluster_id}")
        raise
    return list(response.stages)


def list_jobs(sessions: Iterable[ClusterSession], job_id: str = "") -> list[JobRecord]:
    """Every job the sessions' accounts may see, merged across clusters, oldest first."""
    jobs: dict[str, JobRecord] = {}
    for session in sessions:
        for info in list_stage_infos(session, job_id):
            record = jobs.setdefault(info.status.job_id, JobRecord(info.status.job_id))
            record.stages.append(StageView.from_info(session.endpoints.cluster_id, info))
    return sorted(jobs.values(), key=lambda job: (job.started_unix, job.job_id))


def get_job(sessions: Iterable[ClusterSession], job_id: str) -> JobRecord:
    """One job's record; ``JobNotFoundError`` when no cluster shows it to these accounts."""
    found = list_jobs(sessions, job_id)
    if not found:
        raise JobNotFoundError(f"no job {job_id!r} visible to these accounts on any cluster")
    return found[0]


def cancel_job(sessions: Iterable[ClusterSession], job_id: str, wait_s: float = CANCEL_WAIT_S) -> JobRecord:
    """Cancel the job's stage in every cluster that shows it, then wait (bounded) until all ended.

    Returns the job's record as it then is: ``ended`` says whether every stage stopped in time.
    """
    sessions = list(sessions)
    job = get_job(sessions, job_id)
    by_cluster = {s.endpoints.cluster_id: s for s in sessions}
    for stage in job.stages:
        if not stage.ended:
            by_cluster[stage.cluster].cancel(job_id)
    deadline = time.monotonic() + wait_s
    while not job.ended and time.monotonic() < deadline:
        time.sleep(0.2)
        job = get_job(sessions, job_id)
    return job


def recorded_stage_infos(data_dir: Path) -> list[trainer_pb2.StageRecordInfo]:
    """What ``ListStages`` would show, read from a stopped trainer's stage records (read-only).

    An ended stage's record holds its final status; one the deployment stopped under holds only
    its state (RUNNING or RECOVERING): that is how it stands until the trainer is started again
    and resumes it. A record that cannot be read is skipped (the trainer logs those at its start).
    """
    root = Path(data_dir) / RECORDS_DIR
    infos = []
    for path in sorted(root.glob("*/*.json")) if root.is_dir() else []:
        if path.name.startswith(".") or path.is_symlink():
            continue
        try:
            record = StageRecord.from_json(path.read_bytes(), path)
        except (OSError, RecordError):
            continue
        latest = record.final if record.terminal and record.final is not None else None
        if latest is None:
            latest = trainer_pb2.StageStatus(job_id=record.job_id, stage=record.stage, state=record.state)
        infos.append(record.info(latest))
    return infos


def recorded_history(data_dir: Path, owner: str, job_id: str, stage: str) -> list[trainer_pb2.StageStatus]:
    """Every step a stopped trainer's history file holds of one stage (``services/trainer/history.py``)."""
    try:
        path = StageRecords(Path(data_dir)).path(owner, job_id)
    except RecordError:
        return []
    return read_history(history_path(path), job_id, stage)


def list_recorded_jobs(
    records: dict[str, Path], owners: dict[str, str] | None = None, job_id: str = ""
) -> list[JobRecord]:
    """``list_jobs`` for a stopped deployment: each cluster's trainer records (cluster -> data dir).

    ``owners`` (cluster -> account) keeps only that account's stages, as the trainers would answer
    it; None shows every stage (an admin's view: whoever reads the run directory is its operator).
    """
    jobs: dict[str, JobRecord] = {}
    for cluster, data_dir in sorted(records.items()):
        if owners is not None and cluster not in owners:
            continue
        for info in recorded_stage_infos(data_dir):
            if (job_id and info.status.job_id != job_id) or (
                owners is not None and info.owner != owners[cluster]
            ):
                continue
            record = jobs.setdefault(info.status.job_id, JobRecord(info.status.job_id))
            record.stages.append(StageView.from_info(cluster, info))
    return sorted(jobs.values(), key=lambda job: (job.started_unix, job.job_id))


__all__ = [
    "CANCEL_WAIT_S",
    "JobNotFoundError",
    "JobRecord",
    "StageView",
    "cancel_job",
    "get_job",
    "list_jobs",
    "list_recorded_jobs",
    "list_stage_infos",
    "recorded_stage_infos",
]
