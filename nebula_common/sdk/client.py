"""Typed client for one Nebula deployment: log in per cluster, submit a split job, watch it.

Each cluster's half of a job is submitted with a token from THAT cluster's
auth service: the SDK holds one session per cluster and never reuses a token
across clusters, so each organisation keeps control of its own hardware.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nebula_common.clients.auth import AuthClient
from nebula_common.clients.endpoints import ClusterEndpoints
from nebula_common.errors import AuthenticationError, InvalidRequestError, NebulaError, PermissionDeniedError
from nebula_common.proto.nebula.v1 import relay_pb2, relay_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from nebula_common.rpc import bearer_metadata
from nebula_common.rpc.internal_tls import internal_channel
from nebula_common.sdk.jobs import ProgramJob
from nebula_common.sdk.links import LinkProfile

_STATUS_ERRORS: dict[grpc.StatusCode, type[NebulaError]] = {
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
}
# A dropped stream (trainer killed, restarting or shutting down): re-open it.
_RECONNECT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
WATCH_RECONNECT_S = 180.0
TRAINER_WAIT_S = 30.0
"""How long ``assign``/``cancel`` wait for a trainer that accepts no connection (one being restarted
by its supervisor is back in seconds) before they fail naming it."""
WATCH_BACKOFF_S = (0.1, 2.0)
# The SDK's channel to a trainer retries its connection at most this far apart, so a watch notices
# a restarted trainer within about this long (gRPC's default backoff grows to 120 s).
_TRAINER_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
TERMINAL = {
    trainer_pb2.STAGE_STATE_SUCCEEDED,
    trainer_pb2.STAGE_STATE_FAILED,
    trainer_pb2.STAGE_STATE_CANCELLED,
}


def _dropped(exc: grpc.RpcError) -> bool:
    """The stream was lost (not refused): a killed peer's "Stream removed" may come as UNKNOWN."""
    code = exc.code()
    return code in _RECONNECT_CODES or (
        code == grpc.StatusCode.UNKNOWN and "Stream removed" in (exc.details() or "")
    )


def _raise_for(exc: grpc.RpcError, what: str) -> None:
    error = _STATUS_ERRORS.get(exc.code(), NebulaError)
    raise error(f"{what}: {exc.details()}") from exc


class ClusterSession:
    """A logged-in handle on one cluster."""

    def __init__(
        self,
        endpoints: ClusterEndpoints,
        token: str,
        username: str,
        *,
        watch_reconnect_s: float = WATCH_RECONNECT_S,
        trainer_wait_s: float = TRAINER_WAIT_S,
    ) -> None:
        if watch_reconnect_s < 0:
            raise ValueError(f"watch_reconnect_s must be >= 0, got {watch_reconnect_s}")
        if trainer_wait_s < 0:
            raise ValueError(f"trainer_wait_s must be >= 0, got {trainer_wait_s}")
        self.trainer_wait_s = trainer_wait_s
        self.endpoints = endpoints
        self.username = username
        self.watch_reconnect_s = watch_reconnect_s
        self._token = token
        self._trainer_channel = internal_channel(
            endpoints.trainer, service="trainer", options=_TRAINER_CHANNEL_OPTIONS
        )
        self._switch_channel = internal_channel(endpoints.switch, service="switch")
        self.trainer = trainer_pb2_grpc.TrainerStub(self._trainer_channel)
        self._trainer_health = health_pb2_grpc.HealthStub(self._trainer_channel)
        self.relay = relay_pb2_grpc.RelayStub(self._switch_channel)

    @classmethod
    def login(cls, endpoints: ClusterEndpoints, username: str, password: str) -> ClusterSession:
        with AuthClient(endpoints.auth) as auth:
            result = auth.login(username, password)
        return cls(endpoints, result.token, username)

    @property
    def token(self) -> str:
        """This cluster's token for this account (never sent to any other cluster)."""
        return self._token

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return bearer_metadata(self._token)

    def _await_trainer(self, what: str) -> None:
        """Wait (bounded) until the trainer accepts a connection: a submit or cancel issued while its
        supervisor restarts it goes through a few seconds later instead of failing "connection refused".
        Only connecting is waited for; a call that reached the trainer is never retried.

        The wait is one grpc.health.v1 ``Check`` with ``wait_for_ready`` and a deadline of
        ``trainer_wait_s``: any answer (even UNIMPLEMENTED or NOT_FOUND) means the trainer is
        reachable. A call, unlike ``grpc.channel_ready_future``, leaves no watcher thread behind on the
        channel (that one logs "Channel closed!" once the session is closed)."""
        try:
            self._trainer_health.Check(
                health_pb2.HealthCheckRequest(service=""),
                timeout=self.trainer_wait_s,
                wait_for_ready=True,
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise NebulaError(
                    f"{what}: cluster {self.endpoints.cluster_id}'s trainer at {self.endpoints.trainer} "
                    f"accepted no connection for {self.trainer_wait_s:g} s"
                ) from None
            # Anything else (UNIMPLEMENTED, a draining server's UNAVAILABLE, ...) came from the
            # trainer's server: it is reachable, and the call itself reports what it answers.

    def assign(self, spec: trainer_pb2.StageSpec) -> trainer_pb2.AssignStageResponse:
        self._await_trainer(f"cluster {self.endpoints.cluster_id} refused stage {spec.stage!r}")
        try:
            return self.trainer.AssignStage(
                trainer_pb2.AssignStageRequest(spec=spec), metadata=self.metadata, timeout=30
            )
        except grpc.RpcError as exc:
            _raise_for(exc, f"cluster {self.endpoints.cluster_id} refused stage {spec.stage!r}")
            raise

    def watch(self, job_id: str, reconnect_s: float | None = None) -> Iterator[trainer_pb2.StageStatus]:
        """The stage's statuses until its final one, riding through a restart of its trainer.

        A trainer that is killed or restarted drops the stream (UNAVAILABLE), and for a moment after
        its restart may not know the stage yet (NOT_FOUND); the watch then re-opens with a backoff
        (0.1 s doubling to 2 s) for up to ``reconnect_s`` (``watch_reconnect_s``, 180 s by default)
        from the moment it lost the stream, which covers a supervisor's restart and the stage's
        restore. Each re-opened stream repeats the stage's history; statuses already yielded are
        skipped, so the caller sees every status once and the final one exactly once. NOT_FOUND on
        the first call is not retried (a wrong job id must fail at once), nor is any other error.
        """
        budget = self.watch_reconnect_s if reconnect_s is None else reconnect_s
        request = trainer_pb2.WatchStageRequest(job_id=job_id)
        what = f"watching job {job_id} on cluster {self.endpoints.cluster_id}"
        seen: set[bytes] = set()
        lost_at: float | None = None  # when the stream was lost (None: it is up, or was never up)
        delay = WATCH_BACKOFF_S[0]
        while True:
            try:
                for status in self.trainer.WatchStage(request, metadata=self.metadata):
                    lost_at, delay = None, WATCH_BACKOFF_S[0]
                    key = status.SerializeToString(deterministic=True)
                    if key in seen:
                        continue
                    seen.add(key)
                    yield status
                    if status.state in TERMINAL:
                        return
                problem = "the stream ended before the stage did"
            except grpc.RpcError as exc:
                code = exc.code()
                if not _dropped(exc) and not (code == grpc.StatusCode.NOT_FOUND and seen):
                    _raise_for(exc, what)
                    raise
                problem = f"{code.name}: {exc.details()}"
            now = time.monotonic()
            lost_at = now if lost_at is None else lost_at
            if now - lost_at >= budget:
                raise NebulaError(f"{what}: trainer unreachable for {budget:.0f} s (last: {problem})")
            time.sleep(min(delay, max(0.0, lost_at + budget - now)))
            delay = min(delay * 2, WATCH_BACKOFF_S[1])

    def cancel(self, job_id: str) -> None:
        self._await_trainer(f"cancelling job {job_id} on cluster {self.endpoints.cluster_id}")
        try:
            self.trainer.CancelStage(
                trainer_pb2.CancelStageRequest(job_id=job_id), metadata=self.metadata, timeout=10
            )
        except grpc.RpcError as exc:
            _raise_for(exc, f"cancelling job {job_id} on cluster {self.endpoints.cluster_id}")

    def list_checkpoints(self, job_id: str, stage: str) -> list[int]:
        """Steps at which this cluster holds a checkpoint of ``stage`` of ``job_id`` ([] if none)."""
        try:
            response = self.trainer.ListCheckpoints(
                trainer_pb2.ListCheckpointsRequest(job_id=job_id, stage=stage),
                metadata=self.metadata,
                timeout=10,
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return []
            _raise_for(exc, f"listing checkpoints on cluster {self.endpoints.cluster_id}")
            raise
        return list(response.steps)

    def link_status(self, peer_cluster: str = "", *, measure: bool = False) -> relay_pb2.LinkStatus:
        """The switch's link to ``peer_cluster`` (empty: its first peer, the only one of two clusters).

        ``measure``: the switch measures the bandwidth toward that peer first (or reuses a result
        younger than a minute; ``services/switch/bandwidth.py``): ``bandwidth_bps``.
        """
        request = relay_pb2.GetLinkStatusRequest(peer_cluster=peer_cluster, measure_bandwidth=measure)
        try:
            return self.relay.GetLinkStatus(request, metadata=self.metadata, timeout=20 if measure else 10)
        except grpc.RpcError as exc:
            _raise_for(exc, f"link status of cluster {self.endpoints.cluster_id}")
            raise

    def link_statuses(self) -> dict[str, relay_pb2.LinkStatus]:
        """Every link of the switch, by peer cluster, in its configuration order (``LinkStatus.peers``;
        a switch older than that field reports its first peer's link only)."""
        first = self.link_status()
        statuses = {first.expected_peer: first}
        for peer in first.peers:
            if peer not in statuses:
                statuses[peer] = self.link_status(peer)
        return statuses

    def close(self) -> None:
        self._trainer_channel.close()
        self._switch_channel.close()


@dataclass
class StageUpdate:
    cluster_id: str
    status: trainer_pb2.StageStatus


class SubmittedJob(Protocol):
    """What a handle needs of a job (``ProgramJob`` has it): the id both clusters know, its length."""

    @property
    def job_id(self) -> str: ...

    @property
    def steps(self) -> int: ...


class JobHandle:
    """A submitted split job; iterate ``updates()`` for live status from both clusters."""

    def __init__(
        self, job: SubmittedJob, stages: dict[str, ClusterSession], placements: dict[str, str] | None = None
    ) -> None:
        self.job = job
        self.stages = stages
        self.placements = placements or {}
        """stage -> where its trainer runs it and how it is confined (``AssignStageResponse.placement``)."""
        self.final: dict[str, trainer_pb2.StageStatus] = {}

    def updates(self) -> Iterator[StageUpdate]:
        """Merge both stages' status streams; ends when both stages reach a terminal state."""
        merged: queue.Queue[StageUpdate | BaseException | None] = queue.Queue()

        def pump(stage: str, session: ClusterSession) -> None:
            try:
                for status in session.watch(self.job.job_id):
                    merged.put(StageUpdate(session.endpoints.cluster_id, status))
            except BaseException as exc:
                merged.put(exc)
            finally:
                merged.put(None)

        threads = [
            threading.Thread(target=pump, args=(stage, session), daemon=True)
            for stage, session in self.stages.items()
        ]
        for thread in threads:
            thread.start()
        remaining = len(threads)
        while remaining:
            item = merged.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            if item.status.state in TERMINAL:
                self.final[item.status.stage] = item.status
            yield item

    def cancel(self) -> None:
        for session in self.stages.values():
            session.cancel(self.job.job_id)


def submit_job(
    job: ProgramJob,
    sessions: dict[str, ClusterSession],
    link: LinkProfile | None = None,
    *,
    links: Mapping[str, LinkProfile] | None = None,
    measure_links: bool = True,
) -> JobHandle:
    """Start every stage of a program job in its cluster, upstream first, each with that cluster's token.

    ``sessions`` maps cluster id -> a logged-in session of that cluster. If any
    cluster refuses its stage, the stages already started are cancelled. A codec
    of `auto` is resolved first, once, by the source cluster's codec service for
    ``link`` (see ``codec_advice``), so both clusters get the same concrete codecs.
    In a chain each edge is advised by its sending cluster's codec service for its own
    link: ``links[edge name]``, else ``link``. With ``measure_links`` (the default) an edge's link is
    the one its sending cluster's switch measures toward the receiving cluster (``switch_link``), the
    stated one only when it cannot be measured (the choice record's ``link.source`` says which and why);
    ``measure_links=False`` takes the stated links as they are (a hypothetical WAN the deployment lacks).
    """
    clusters = job.clusters()
    missing = sorted(set(clusters.values()) - set(sessions))
    if missing:
        raise InvalidRequestError(f"no session for cluster(s) {', '.join(missing)} named in the job spec")
    # Advice measures a micro-batch with torch: imported here, so listing or cancelling jobs never does.
    from nebula_common.codec import CodecError
    from nebula_common.codec.advice_client import AdviceUnavailableError
    from nebula_common.sdk.codec_advice import needs_advice

    if needs_advice(job):
        from nebula_common.sdk.auto_resolve import resolve_auto

        try:
            resolve_auto(job, sessions, link, dict(links or {}), measure_links)
        except (CodecError, AdviceUnavailableError) as exc:
            raise NebulaError(f"codec advice failed: {exc}") from exc
    started: list[ClusterSession] = []
    stages: dict[str, ClusterSession] = {}
    placements: dict[str, str] = {}
    for stage, cluster in clusters.items():
        session = sessions[cluster]
        try:
            placements[stage] = session.assign(job.stage_spec(stage)).placement
        except NebulaError:
            for done in started:
                done.cancel(job.job_id)
            raise
        started.append(session)
        stages[stage] = session
    return JobHandle(job, stages, placements)


def common_checkpoint_step(job_id: str, stages: dict[str, ClusterSession]) -> int | None:
    """The latest step at which every cluster holds its stage's checkpoint (None if there is none)."""
    common: set[int] | None = None
    for stage, session in stages.items():
        held = set(session.list_checkpoints(job_id, stage))
        common = held if common is None else common & held
    return max(common) if common else None
