"""A job runs longer than any token it was given, and survives a trainer restart after they all expired.

A deployment of its own where account tokens and job tokens live 5 s (verifiers accept 30 s of clock
skew past that). The job runs for a minute or more; 40 s after the submit, when the submitter's token
and the first job tokens are refused everywhere, trainer a is killed with SIGKILL. Its supervisor
restarts it; it can resume the stage only with the job token it renewed while the job ran (a record
holding the first one would fail the stage at once: "token expired"). The job must end SUCCEEDED on
both clusters, the restored stage audited ``stage.recover`` ok, and auth must have renewed job tokens.
Then trainer b, which ran its stage throughout, must exit by itself on SIGTERM.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import jwt
import pytest

from nebula_common.audit.query import AuditFilter, query_log
from nebula_common.auth.verifier import LEEWAY_SECONDS
from nebula_common.errors import AuthenticationError
from nebula_common.launcher import LocalDeployment
from nebula_common.proto.nebula.v1 import relay_pb2, relay_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from nebula_common.rpc import bearer_metadata
from nebula_common.rpc.framing import LINK_FRAMING_VERSION
from nebula_common.sdk.client import ClusterSession
from tests.support.accounts import create_account
from tests.support.internal import service_channel, user_channel
from tests.support.jobs import numbers_job
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.timeout(420)]

TTL_S = "5"
KILL_AFTER_S = 40.0  # past the 5 s lifetime and the 30 s leeway of the submitter's token
STEPS = 600  # about a minute of stepping on an idle machine, so the kill lands mid-job
TERMINAL = (
    trainer_pb2.STAGE_STATE_SUCCEEDED,
    trainer_pb2.STAGE_STATE_FAILED,
    trainer_pb2.STAGE_STATE_CANCELLED,
)


@pytest.fixture(scope="module")
def short_tokens(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NEBULA_AUTH_TOKEN_TTL_SECONDS", TTL_S)  # the services inherit it
        patch.setenv("NEBULA_AUTH_JOB_TOKEN_TTL_SECONDS", TTL_S)
        running = LocalDeployment(
            run_dir=tmp_path_factory.mktemp("short-tokens"), bandwidth_mbit=100.0, delay_ms=5.0
        )
        running.start()
    try:
        yield running
    finally:
        running.stop()


def _status(
    deployment: LocalDeployment, cluster: str, user: tuple[str, str], job_id: str
) -> trainer_pb2.StageStatus:
    """The stage's latest status (ListStages), asked with a fresh login: every token here is seconds old."""
    session = ClusterSession.login(deployment.endpoints(cluster), *user)
    try:
        with user_channel(deployment.endpoints(cluster).trainer, "trainer") as channel:
            reply = trainer_pb2_grpc.TrainerStub(channel).ListStages(
                trainer_pb2.ListStagesRequest(job_id=job_id), metadata=session.metadata, timeout=10
            )
    finally:
        session.close()
    (stage,) = reply.stages
    return stage.status


def test_a_job_outlives_every_token_and_a_trainer_restart(short_tokens: LocalDeployment) -> None:
    deployment = short_tokens
    users = {}
    for cluster in ("a", "b"):
        name = f"long-{cluster}-{secrets.token_hex(2)}"
        users[cluster] = (name, create_account(deployment, cluster, name))
    job = numbers_job(steps=STEPS, checkpoint__interval=20)
    submitted = time.monotonic()
    first_tokens = {}
    for cluster, stage in (("a", "encoder"), ("b", "decoder")):
        session = ClusterSession.login(deployment.endpoints(cluster), *users[cluster])
        session.assign(job.stage_spec(stage))
        first_tokens[cluster] = session.token
        session.close()

    wait_for(
        lambda: time.monotonic() - submitted >= KILL_AFTER_S,
        KILL_AFTER_S + 5,
        f"{KILL_AFTER_S} s since the submit",
        interval=0.5,
    )
    running = _status(deployment, "a", users["a"], job.job_id)
    assert running.state in (trainer_pb2.STAGE_STATE_RUNNING, trainer_pb2.STAGE_STATE_RECOVERING), running
    # The submitter's token is dead by now: only the renewed job token can carry the stage on.
    stale = ClusterSession(deployment.endpoints("a"), first_tokens["a"], users["a"][0])
    with pytest.raises(AuthenticationError, match="token expired"):
        next(iter(stale.watch(job.job_id)))
    stale.close()

    os.kill(deployment.process("trainer-a").pid, signal.SIGKILL)  # type: ignore[arg-type]
    killed_at_step = running.steps_done
    finals: dict[str, trainer_pb2.StageStatus] = {}

    def ended() -> bool:
        for cluster in ("a", "b"):
            try:
                status = _status(deployment, cluster, users[cluster], job.job_id)
            except grpc.RpcError:  # trainer a is restarting
                return False
            if status.state in TERMINAL:
                finals[cluster] = status
        return len(finals) == 2

    wait_for(ended, 300.0, f"job {job.job_id} ended on both clusters after trainer a's restart", interval=1.0)
    assert {c: trainer_pb2.StageState.Name(s.state) for c, s in finals.items()} == {
        "a": "STAGE_STATE_SUCCEEDED",
        "b": "STAGE_STATE_SUCCEEDED",
    }, finals
    assert finals["a"].epoch >= 1 and finals["a"].steps_done == STEPS > killed_at_step
    # The restarted trainer still shows every step of the stage, those before its kill included
    # (its history file, services/trainer/history.py), each epoch's in order.
    session = ClusterSession.login(deployment.endpoints("a"), *users["a"])
    try:
        steps: dict[int, list[int]] = {}
        for status in session.watch(job.job_id):
            if status.steps_done and status.state == trainer_pb2.STAGE_STATE_RUNNING:
                steps.setdefault(status.epoch, []).append(status.steps_done)
    finally:
        session.close()
    assert steps[0][:3] == [1, 2, 3] and steps[0][-1] >= killed_at_step - 1, steps.get(0)
    assert steps[0] == sorted(steps[0]) and max(steps) >= 1 and steps[max(steps)][-1] == STEPS
    recover = query_log(
        deployment.run_dir / "a" / "trainer" / "audit.log",
        AuditFilter(event="stage.recover", job_id=job.job_id),
    )
    assert [r["outcome"] for r in recover.records] == ["ok"], recover.records
    issued = [
        json.loads(line)
        for line in Path(deployment.run_dir / "a" / "auth" / "audit.log").read_text().splitlines()
        if '"token.job_issue"' in line
    ]
    renewals = [r for r in issued if r["details"]["job_id"] == job.job_id and r["details"]["renewal"]]
    assert len(renewals) >= 5, issued

    # A trainer that ran stages exits by itself on SIGTERM (no idle worker thread holds it until the
    # launcher's SIGKILL 15 s later).
    started = time.monotonic()
    assert deployment.process("trainer-b").stop() == 0
    assert time.monotonic() - started < 10.0


class _HeldEdge:
    """One edge held open on switch a through the trainer's certificate, its messages collected."""

    def __init__(self, deployment: LocalDeployment, token: str, job_id: str) -> None:
        self._done = threading.Event()
        self.messages: list[tuple[float, relay_pb2.EdgeMessage]] = []
        self.ended = threading.Event()
        self._channel = service_channel(deployment, "a", "switch", as_role="trainer")
        opening = relay_pb2.EdgeMessage(
            open=relay_pb2.EdgeOpen(job_id=job_id, edge="cut", link_framing=LINK_FRAMING_VERSION)
        )
        self._call = relay_pb2_grpc.RelayStub(self._channel).OpenEdge(
            self._requests(opening), metadata=bearer_metadata(token), timeout=180
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _requests(self, opening: relay_pb2.EdgeMessage) -> Iterator[relay_pb2.EdgeMessage]:
        yield opening
        self._done.wait(180)  # never half-close: a trainer keeps its edge open until told otherwise

    def _read(self) -> None:
        try:
            for message in self._call:
                self.messages.append((time.time(), message))
        except grpc.RpcError:
            pass
        self.ended.set()

    def closes(self) -> list[tuple[float, relay_pb2.EdgeClose]]:
        return [(at, m.close) for at, m in self.messages if m.WhichOneof("body") == "close"]

    def release(self) -> None:
        self._done.set()
        self._call.cancel()
        self._reader.join(10)
        self._channel.close()


def test_an_edge_ends_when_its_token_expires_unless_renewed(short_tokens: LocalDeployment) -> None:
    """Two edges of one account open with 5 s tokens; only one is renewed (``Relay/RenewEdges``).

    The other must end within 10 s of the moment every service refuses its token (``exp`` plus the
    verifiers' 30 s of clock-skew leeway), with the reason on the stream and in switch a's audit log;
    the renewed one must still be open then. Another account's renewal moves neither.
    """
    deployment = short_tokens
    name = f"expiry-{secrets.token_hex(2)}"
    user = (name, create_account(deployment, "a", name))
    stranger = f"stranger-{secrets.token_hex(2)}"
    stranger_user = (stranger, create_account(deployment, "a", stranger))
    jobs = {"lapsed": f"lapsed-{secrets.token_hex(3)}", "renewed": f"renewed-{secrets.token_hex(3)}"}
    opened = ClusterSession.login(deployment.endpoints("a"), *user)
    expires_at = float(jwt.decode(opened.token, options={"verify_signature": False})["exp"])
    edges = {kind: _HeldEdge(deployment, opened.token, job_id) for kind, job_id in jobs.items()}
    opened.close()
    renewals: list[int] = []
    try:
        with service_channel(deployment, "a", "switch", as_role="trainer") as channel:
            relay = relay_pb2_grpc.RelayStub(channel)

            def renew(who: tuple[str, str], job_id: str) -> int:
                session = ClusterSession.login(deployment.endpoints("a"), *who)
                try:
                    request = relay_pb2.RenewEdgesRequest(job_id=job_id)
                    return int(relay.RenewEdges(request, metadata=session.metadata, timeout=10).renewed)
                finally:
                    session.close()

            wait_for(
                lambda: renew(user, jobs["renewed"]) == 1,
                30.0,
                "switch a renews the open edge of the renewed job",
                interval=0.2,
            )
            assert renew(stranger_user, jobs["lapsed"]) == 0  # not its account's edge

            deadline = expires_at + LEEWAY_SECONDS + 10.0

            def lapsed_closed() -> bool:
                renewals.append(renew(user, jobs["renewed"]))  # a trainer renewing every few seconds
                return bool(edges["lapsed"].closes())

            wait_for(
                lambda: lapsed_closed() or time.time() > deadline,
                deadline - time.time() + 15.0,
                "the lapsed edge closed or its deadline passed",
                interval=2.0,
            )
        closes = edges["lapsed"].closes()
        assert closes, f"the edge opened with a token that expired at {expires_at:.0f} is still open"
        closed_at, close = closes[0]
        assert expires_at + LEEWAY_SECONDS - 2.0 <= closed_at <= deadline, (closed_at, expires_at)
        assert close.error and "expired" in close.reason and name in close.reason, close
        assert edges["renewed"].closes() == [] and not edges["renewed"].ended.is_set()
        assert renewals and all(count == 1 for count in renewals), renewals
        records = query_log(
            deployment.run_dir / "a" / "switch" / "audit.log",
            AuditFilter(event="route.closed", job_id=jobs["lapsed"]),
        ).records
        closed = [(r["account"], "expired" in r["details"]["reason"]) for r in records]
        assert closed == [(name, True)], records
    finally:
        for edge in edges.values():
            edge.release()
