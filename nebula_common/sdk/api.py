"""The SDK in two objects: a ``Deployment`` you connect to and the ``Job`` s you run on it.

Everything else in ``nebula_common.sdk`` (sessions per cluster, stage specs, codec advice,
watching, summaries, records) stays available for whoever needs one piece; this module is the
path a data scientist takes::

    from nebula import Deployment

    with Deployment.from_run_dir("runs/local") as deployment:
        job = deployment.submit("examples/digit_sum/job.yaml", {"steps": 20})
        summary = job.wait(progress=True)

A spec is a path, a YAML string or a dict (module paths in a string or dict are relative to
``base_dir``, the working directory by default). Accounts: with ``credentials`` every call acts as
those accounts; without, jobs are submitted as a fresh account per cluster (created once per
``Deployment`` through each cluster's admin, shown in ``deployment.credentials``), and ``jobs()``
/ ``job(id)`` look as each cluster's admin, who sees every job.
"""

from __future__ import annotations

import copy
import heapq
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import yaml

from nebula_common.errors import NebulaError
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.client import ClusterSession, JobHandle, submit_job
from nebula_common.sdk.deployment import Credentials, DeploymentTarget, read_credentials
from nebula_common.sdk.job_logs import command_log_records, job_log_records
from nebula_common.sdk.job_records import (
    CANCEL_WAIT_S,
    JobNotFoundError,
    JobRecord,
    cancel_job,
    get_job,
    list_jobs,
    list_recorded_jobs,
    recorded_history,
)
from nebula_common.sdk.jobs import ProgramJob
from nebula_common.sdk.progress import ProgressBar
from nebula_common.sdk.report import write_report
from nebula_common.sdk.summary import JobSummary, summarize

if TYPE_CHECKING:  # specs are pydantic models: built when a job is loaded, not to list or watch jobs
    from nebula_common.jobspec import LoadedJob

SpecSource = Path | str | dict[str, Any]


def load_job(
    spec: SpecSource, overrides: dict[str, Any] | None = None, base_dir: Path | None = None
) -> LoadedJob:
    """A validated job from a spec path, YAML text or dict; ``SpecError`` names what is wrong.

    A ``str`` is a path when it names an existing file or ends in ``.yaml``/``.yml`` on one line,
    YAML text otherwise. ``overrides`` use dotted keys (``edges.0.codec.forward``) as ``--set`` does.
    """
    from nebula_common.jobspec import SpecError, load_spec
    from nebula_common.jobspec.loader import parse_spec, set_dotted

    if isinstance(spec, Path) or (isinstance(spec, str) and _looks_like_path(spec)):
        return load_spec(Path(spec), overrides)
    origin = "spec dict"
    if isinstance(spec, str):
        origin = "spec text"
        try:
            data = yaml.safe_load(spec)
        except yaml.YAMLError as exc:
            raise SpecError(f"{origin}: not valid YAML: {exc}") from None
    elif isinstance(spec, dict):
        data = copy.deepcopy(spec)
    else:
        raise SpecError(f"a spec is a path, YAML text or a dict, got {type(spec).__name__}")
    if isinstance(data, dict):
        for dotted, value in (overrides or {}).items():
            set_dotted(data, dotted, value, origin)
    return parse_spec(data, base_dir=Path(base_dir or Path.cwd()), origin=origin)


def _looks_like_path(text: str) -> bool:
    return "\n" not in text and (Path(text).is_file() or text.endswith((".yaml", ".yml")))


class DeploymentStoppedError(NebulaError):
    """The deployment is not running: what needs its services (submit, cancel) cannot be done."""


@dataclass(frozen=True)
class _Recorded:
    """A stopped deployment's stage records, as much of a ``JobHandle`` as ``summarize`` reads: every
    step each stage's history file holds (the stages' steps interleaved, as a live watch sees them),
    then each stage's last recorded status (an ended stage's final one), upstream first."""

    record: JobRecord
    data_dirs: dict[str, Path]
    """Cluster -> its trainer's data dir (``Deployment.stopped``)."""

    @property
    def stages(self) -> dict[str, None]:
        return {stage: None for stage in self.record.clusters}

    def updates(self) -> Iterator[Any]:
        histories = [
            recorded_history(self.data_dirs[view.cluster], view.owner, self.record.job_id, view.stage)
            for view in self.record._ordered()
            if view.cluster in self.data_dirs
        ]
        for status in heapq.merge(*histories, key=lambda status: status.steps_done):
            yield _Update(status)
        for view in self.record._ordered():
            status = trainer_pb2.StageStatus(
                job_id=self.record.job_id,
                stage=view.stage,
                state=trainer_pb2.StageState.Value(f"STAGE_STATE_{view.state}"),
                message=view.message,
                steps_done=view.steps_done,
                step_seconds=view.step_seconds,
                bytes_sent=view.bytes_sent,
                raw_bytes_sent=view.raw_bytes_sent,
            )
            if view.loss is not None:
                status.loss = view.loss
            yield _Update(status)


@dataclass(frozen=True)
class _Update:
    status: trainer_pb2.StageStatus


@dataclass(frozen=True)
class _Watched:
    """What ``JobHandle`` and ``summarize`` need of a job this process did not submit."""

    job_id: str
    steps: int


class Job:
    """One job on a deployment: its status, live metrics, its end and summary, a cancel, a report."""

    def __init__(
        self,
        deployment: Deployment,
        job_id: str,
        sessions: dict[str, ClusterSession],
        program: ProgramJob | None,
    ) -> None:
        self.deployment = deployment
        self.id = job_id
        self.program = program
        self._sessions = sessions  # cluster -> the session that sees this job there
        self.summary: JobSummary | None = None

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def status(self) -> JobRecord:
        """The job's record now: state, step, loss, owners, bytes each way, how each stage ended.

        On a stopped deployment: as its trainers' stage records left it (``Deployment.stopped``).
        """
        if self.deployment.stopped is not None:
            return self.deployment.recorded_job(self.id)
        return get_job(self._sessions.values(), self.id)

    def _handle(self) -> tuple[JobHandle, JobRecord]:
        record = self.status()
        stages = {stage.stage: self._sessions[stage.cluster] for stage in record.stages}
        return JobHandle(self.program or _Watched(self.id, record.steps), stages), record

    def metrics(self) -> Iterator[trainer_pb2.StageStatus]:
        """Every status of every stage (one per step, with loss, step time, bytes) until the job ends.

        On a stopped deployment: each stage's last recorded status only.
        """
        if self.deployment.stopped is not None:
            for update in _Recorded(self.status(), self.deployment.stopped).updates():
                yield update.status
            return
        handle, _ = self._handle()
        for update in handle.updates():
            yield update.status

    def wait(self, progress: bool = False) -> JobSummary:
        """Follow the job to its end (a progress bar on stderr if ``progress``); its summary.

        The summary's WAN numbers are this job's own (the switches' per-job counters). On a stopped
        deployment the summary is the stages' records: final numbers, no per-step history, and the
        WAN bytes the trainers' edges counted (``counted_by: trainers``).
        """
        if self.deployment.stopped is not None:
            record = self.status()
            summary = summarize(_Watched(self.id, record.steps), _Recorded(record, self.deployment.stopped))  # type: ignore[arg-type]
            clusters = list(record.clusters.values())
            if len(clusters) == 2:
                summary._fill_wan_from_stages(clusters[0], clusters[1])
            self.summary = summary
            return summary
        handle, record = self._handle()
        job = self.program or _Watched(self.id, record.steps)
        with ProgressBar(self.id, record.steps, record.steps_done, disable=not progress) as bar:
            summary = summarize(job, handle, on_status=bar.update)
        ordered = [self._sessions[cluster] for cluster in record.clusters.values()]
        if len(ordered) == 2:
            summary.fill_wan(ordered[0], ordered[1])
        if self.program is not None:
            summary.settings = self.program.settings()
        self.summary = summary
        return summary

    def logs(self) -> list[dict[str, Any]]:
        """The services' JSON log records naming this job, oldest first: a `nebula local up` deployment's
        log files, or what the endpoints file's log command prints (compose, Kubernetes)."""
        if self.deployment.target.logs:
            return command_log_records(self.deployment.target.logs, self.id)
        return job_log_records(self.deployment.target.description, self.id)

    def cancel(self, wait_s: float = CANCEL_WAIT_S) -> JobRecord:
        """Stop every stage of the job; returns its record once all ended (or ``wait_s`` passed)."""
        if self.deployment.stopped is not None:
            raise DeploymentStoppedError(
                f"the deployment is stopped: nothing of job {self.id} runs (its stages stand as "
                f"{self.status().state}); start it again to resume or cancel it"
            )
        return cancel_job(self._sessions.values(), self.id, wait_s)

    def report(self, path: Path | str) -> Path:
        """Write the job's HTML report (and PNGs, with matplotlib) to ``path``; returns the page's path.

        Needs the job's per-step history: a job not yet waited for here is followed to its end first
        (an ended one's history is replayed by its trainers at once).
        """
        summary = self.summary or self.wait()
        page, _ = write_report(summary, self.status(), self.deployment.link, Path(path))
        return page


class Deployment:
    """A running deployment (its ``deployment.json``) and the accounts this program acts as."""

    def __init__(self, target: DeploymentTarget, credentials: Credentials | None = None) -> None:
        self.target = target
        self.credentials = credentials
        self._given = credentials is not None
        self._sessions: dict[str, ClusterSession] = {}
        self._admin: dict[str, ClusterSession] = {}
        # Cluster -> trainer data dir while the deployment is stopped (its jobs are read from there).
        self.stopped: dict[str, Path] | None = target.stopped_records()

    @property
    def records_note(self) -> str | None:
        """What a person should be told when the jobs come from records, not from running trainers."""
        if self.stopped is None:
            return None
        where = ", ".join(str(p) for _, p in sorted(self.stopped.items()))
        return f"(deployment stopped; read from records in {where})"

    def _recorded(self, job_id: str = "") -> list[JobRecord]:
        owners = None
        if self._given:
            owners = {c: e["username"] for c, e in (self.credentials or {}).items()}
        return list_recorded_jobs(self.stopped or {}, owners, job_id)

    def recorded_job(self, job_id: str) -> JobRecord:
        """One job of a stopped deployment, from its records; ``JobNotFoundError`` if none shows it."""
        found = self._recorded(job_id)
        if not found:
            raise JobNotFoundError(f"no job {job_id!r} visible to these accounts in the stopped deployment")
        return found[0]

    @classmethod
    def open(cls, path: Path | str, credentials: Path | str | Credentials | None = None) -> Deployment:
        """From a deployment description (or the run directory holding ``deployment.json``)."""
        source = credentials if isinstance(credentials, dict) or credentials is None else Path(credentials)
        given = read_credentials(source)
        return cls(DeploymentTarget.load(Path(path)), given)

    from_run_dir = open

    def __enter__(self) -> Deployment:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        for session in [*self._sessions.values(), *self._admin.values()]:
            session.close()
        self._sessions.clear()
        self._admin.clear()

    @property
    def link(self) -> Any:
        """The WAN the deployment was started with (what `codec: auto` is advised for), if known."""
        return self.target.link

    def sessions(self, clusters: set[str] | None = None) -> dict[str, ClusterSession]:
        """This program's account in each cluster (created through the admins once, if none given)."""
        wanted = set(self.target.clusters) if clusters is None else clusters
        missing = wanted - set(self._sessions)
        if missing:
            if self._given:
                given = {c: e for c, e in (self.credentials or {}).items() if c in missing}
                self._sessions.update(self.target.login(given))
            else:
                sessions, created = self.target.new_accounts(missing)
                self._sessions.update(sessions)
                self.credentials = {**(self.credentials or {}), **created}
        return {c: s for c, s in self._sessions.items() if c in wanted}

    def _viewers(self) -> dict[str, ClusterSession]:
        if self._given:
            return self.sessions(set(self.credentials or {}))
        if not self._admin:
            self._admin = self.target.admin_sessions()
        return self._admin

    def submit(
        self,
        spec: SpecSource,
        overrides: dict[str, Any] | None = None,
        *,
        base_dir: Path | None = None,
        job_id: str | None = None,
    ) -> Job:
        """Validate the spec and its modules, then start each stage in its cluster; returns the Job."""
        if self.stopped is not None:
            raise DeploymentStoppedError(
                f"the deployment in {self.target.run_dir} is stopped: start it first"
            )
        program = ProgramJob(load_job(spec, overrides, base_dir), job_id)
        sessions = self.sessions(set(program.clusters().values()))
        submit_job(program, sessions, link=self.target.link)
        return Job(self, program.job_id, sessions, program)

    def jobs(self) -> list[JobRecord]:
        """The jobs these accounts may see (every job, as the admins), oldest first.

        On a stopped deployment: from its trainers' stage records (``records_note`` says so).
        """
        if self.stopped is not None:
            return self._recorded()
        return list_jobs(self._viewers().values())

    def job(self, job_id: str) -> Job:
        """A job submitted earlier (by anyone these accounts may see the jobs of): re-attach to it."""
        if self.stopped is not None:
            self.recorded_job(job_id)  # not found for whoever may not see it
            return Job(self, job_id, {}, None)
        viewers = self._viewers()
        record = get_job(viewers.values(), job_id)
        return Job(self, job_id, {s.cluster: viewers[s.cluster] for s in record.stages}, None)


__all__ = ["Deployment", "DeploymentStoppedError", "Job", "SpecSource", "load_job"]
