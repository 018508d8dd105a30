"""Disabling an account ends its tokens at every verifier of the cluster within seconds, and its
running job's live edges with them.

On the real processes: the account reads its dataset, asks the trainer and the switch; an admin
disables it; each of the three services refuses the *same, unexpired* token within a few seconds
(their verifiers poll auth's revocations, no call per request); re-enabling lets a fresh login work
again while the old token stays refused.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from nebula_common.errors import NebulaError
from nebula_common.launcher import LocalDeployment
from nebula_common.proto.nebula.v1 import (
    data_pb2,
    data_pb2_grpc,
    relay_pb2,
    relay_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from nebula_common.rpc import bearer_metadata
from nebula_common.sdk.auth_client import AuthClient
from nebula_common.sdk.client import ClusterSession, submit_job
from nebula_common.sdk.data_client import DataClient
from tests.support.accounts import make_user
from tests.support.internal import user_channel
from tests.support.jobs import numbers_job
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REFUSAL_DEADLINE_S = 5.0
"""Verifiers poll every 2 s; 5 s leaves room for one slow poll on a loaded test machine."""


def _probes(deployment: LocalDeployment, token: str) -> dict[str, Callable[[], None]]:
    """One authenticated call per verifying service; each raises grpc.RpcError when refused."""
    endpoints = deployment.endpoints("a")
    metadata = bearer_metadata(token)

    def data() -> None:
        with user_channel(deployment.data_address("a"), "data") as channel:
            data_pb2_grpc.DataStub(channel).ReadBatch(
                data_pb2.ReadBatchRequest(dataset=data_pb2.DatasetRef(name="corpus"), example_ids=[0]),
                metadata=metadata,
                timeout=10,
            )

    def trainer() -> None:
        with user_channel(endpoints.trainer, "trainer") as channel:
            trainer_pb2_grpc.TrainerStub(channel).ListCheckpoints(
                trainer_pb2.ListCheckpointsRequest(job_id="no-such-job", stage="s0"),
                metadata=metadata,
                timeout=10,
            )

    def switch() -> None:
        with user_channel(endpoints.switch, "switch") as channel:
            relay_pb2_grpc.RelayStub(channel).GetLinkStatus(
                relay_pb2.GetLinkStatusRequest(), metadata=metadata, timeout=10
            )

    return {"data": data, "trainer": trainer, "switch": switch}


def _refusal(probe: Callable[[], None]) -> str | None:
    """The UNAUTHENTICATED detail if ``probe`` is refused for its token, else None (authorised)."""
    try:
        probe()
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
            return str(exc.details())
        # NOT_FOUND for a job that does not exist is an authorised answer.
        assert exc.code() == grpc.StatusCode.NOT_FOUND, (exc.code(), exc.details())
    return None


def test_disabled_account_is_refused_everywhere_within_seconds(deployment: LocalDeployment) -> None:
    password = secrets.token_urlsafe(16)
    with AuthClient(deployment.endpoints("a").auth) as auth:
        admin = auth.login("admin", deployment.cluster_state["a"].admin_password).token
        auth.create_account(admin, "revoked-rita", password)
        token = auth.login("revoked-rita", password).token
        with DataClient(deployment.data_address("a"), token) as data:
            data.upload_records("corpus", [{"text": "one"}, {"text": "two"}])
            assert data.read_batch("corpus", [0]) == [{"text": "one"}]
        probes = _probes(deployment, token)
        assert {name: _refusal(probe) for name, probe in probes.items()} == dict.fromkeys(probes)

        auth.disable_account(admin, "revoked-rita")
        disabled_at = time.monotonic()
        refused_after: dict[str, float] = {}
        while len(refused_after) < len(probes):
            for name, probe in probes.items():
                if name not in refused_after and (reason := _refusal(probe)) is not None:
                    assert "token revoked: account disabled" in reason, (name, reason)
                    refused_after[name] = time.monotonic() - disabled_at
            elapsed = time.monotonic() - disabled_at
            assert elapsed < REFUSAL_DEADLINE_S, f"still accepted after {elapsed:.1f} s: {refused_after}"
            time.sleep(0.1)
        print(f"refused after disable (s): { {k: round(v, 2) for k, v in refused_after.items()} }")

        auth.enable_account(admin, "revoked-rita")
        fresh = auth.login("revoked-rita", password).token
        fresh_probes = _probes(deployment, fresh)
        assert {name: _refusal(probe) for name, probe in fresh_probes.items()} == dict.fromkeys(fresh_probes)
        with DataClient(deployment.data_address("a"), fresh) as data:
            assert data.read_batch("corpus", [1]) == [{"text": "two"}]
        # The token from before the disable stays dead: re-enabling is not an amnesty.
        assert all(_refusal(probe) is not None for probe in probes.values())


def test_disabling_an_account_ends_its_running_job_with_the_reason_on_both_sides(
    deployment: LocalDeployment,
) -> None:
    """The live edges of a disabled account's job end within 10 s: switch a closes its route (audited
    ``route.closed``, bound ``credential``), both stages fail naming why, and nothing is penalised."""
    owner = f"halted-{secrets.token_hex(3)}"
    sessions = {cluster: make_user(deployment, cluster, owner) for cluster in "ab"}
    admins = {
        cluster: ClusterSession.login(
            deployment.endpoints(cluster), "admin", deployment.cluster_state[cluster].admin_password
        )
        for cluster in "ab"
    }
    job = numbers_job(steps=400)
    submit_job(job, sessions)
    stages = {"encoder": admins["a"], "decoder": admins["b"]}  # the owner's token stops working
    try:
        wait_for(
            lambda: all(_status(s, job.job_id).steps_done >= 2 for s in stages.values()),
            120,
            "both stages to train two steps",
            interval=0.2,
        )
        with AuthClient(deployment.endpoints("a").auth) as auth:
            admin = auth.login("admin", deployment.cluster_state["a"].admin_password).token
            auth.disable_account(admin, owner)
        disabled_at = time.monotonic()
        closed = wait_for(
            lambda: [
                r
                for r in _switch_records(deployment, "a", "route.closed")
                if r["job_id"] == job.job_id and r["details"].get("bound") == "credential"
            ],
            10,
            "switch a to close the disabled account's route",
            interval=0.1,
        )
        closed_after = time.monotonic() - disabled_at
        assert "token revoked: account disabled" in closed[0]["details"]["reason"], closed[0]
        assert closed[0]["account"] == owner
        final = {
            name: wait_for(
                lambda s=session: _ended(_status(s, job.job_id)),
                30,
                f"stage {name} to end after the disable",
                interval=0.2,
            )
            for name, session in stages.items()
        }
        for name, status in final.items():
            assert status.state == trainer_pb2.STAGE_STATE_FAILED, (name, status)
            assert "account disabled" in status.message, (name, status.message)
        messages = {n: s.message[:80] for n, s in final.items()}
        print(f"route closed {closed_after:.2f} s after the disable; stages: {messages}")
        with AuthClient(deployment.endpoints("a").auth) as auth:
            admin = auth.login("admin", deployment.cluster_state["a"].admin_password).token
            auth.enable_account(admin, owner)
    finally:
        for session in admins.values():
            with contextlib.suppress(NebulaError):  # ended already, as it should have
                session.cancel(job.job_id)
        for session in (*sessions.values(), *admins.values()):
            session.close()


def _status(session: ClusterSession, job_id: str) -> trainer_pb2.StageStatus:
    with user_channel(session.endpoints.trainer, "trainer") as channel:
        reply = trainer_pb2_grpc.TrainerStub(channel).ListStages(
            trainer_pb2.ListStagesRequest(), metadata=session.metadata, timeout=10
        )
    found = [s.status for s in reply.stages if s.status.job_id == job_id]
    assert found, f"no stage of {job_id} in {session.endpoints.cluster_id}"
    return found[0]


def _ended(status: trainer_pb2.StageStatus) -> trainer_pb2.StageStatus | None:
    done = (
        trainer_pb2.STAGE_STATE_FAILED,
        trainer_pb2.STAGE_STATE_SUCCEEDED,
        trainer_pb2.STAGE_STATE_CANCELLED,
    )
    return status if status.state in done else None


def _switch_records(deployment: LocalDeployment, cluster: str, event: str) -> list[dict[str, Any]]:
    path = deployment.run_dir / cluster / "switch" / "audit.log"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r["event"] == event]
