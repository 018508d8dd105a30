"""A running job acts with a job token, never with its owner's: on the real deployment.

While a stage runs, the trainer holds (on disk and in memory) a token valid for that job's edges and
batches only; the switch names the credential in its ``edge.open`` record; the same token is refused
for every other call, including cancelling its own job, and for another job's edge. The owner's
token is in no file the trainer writes.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import jwt
import pytest

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
from nebula_common.sdk.client import ClusterSession
from tests.support.accounts import make_user
from tests.support.internal import service_channel, user_channel
from tests.support.jobs import numbers_job
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _switch_audit(deployment: LocalDeployment, cluster: str, event: str, job_id: str) -> list[dict[str, Any]]:
    path = deployment.run_dir / cluster / "switch" / "audit.log"
    found = []
    for line in path.read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if record.get("event") == event and record.get("job_id") == job_id:
            details = record.get("details")
            found.append({**record, **(details if isinstance(details, dict) else {})})
    return found


@pytest.fixture(scope="module")
def waiting_job(deployment: LocalDeployment) -> Iterator[dict[str, Any]]:
    """Cluster a's stage of a job whose peer never comes: it opens its edge and waits."""
    owner = f"jobtok-{secrets.token_hex(3)}"
    session: ClusterSession = make_user(deployment, "a", owner)
    job = numbers_job(steps=50)
    session.assign(job.stage_spec("encoder"))
    record = deployment.run_dir / "a" / "trainer" / "stages" / owner / f"{job.job_id}.json"
    wait_for(
        lambda: bool(_switch_audit(deployment, "a", "edge.open", job.job_id)),
        60.0,
        f"switch a audited the edge open of {job.job_id}",
        interval=0.1,
    )
    yield {"session": session, "job": job, "owner": owner, "record": record}
    session.cancel(job.job_id)
    session.close()


def test_the_stage_acts_with_a_token_of_its_job_only(
    deployment: LocalDeployment, waiting_job: dict[str, Any]
) -> None:
    job, owner, session = waiting_job["job"], waiting_job["owner"], waiting_job["session"]
    token = json.loads(Path(waiting_job["record"]).read_text())["token"]
    claims = jwt.decode(token, options={"verify_signature": False})
    assert (claims["sub"], claims["role"], claims["job"]) == (owner, "job", job.job_id)
    assert claims["exp"] - claims["iat"] <= 900
    # The owner's own token is in no file under the trainer's directory.
    leaked = [
        path
        for path in (deployment.run_dir / "a" / "trainer").rglob("*")
        if path.is_file() and session.token.encode() in path.read_bytes()
    ]
    assert leaked == []
    opened = _switch_audit(deployment, "a", "edge.open", job.job_id)
    assert [(r["account"], r.get("credential")) for r in opened] == [(owner, "job")]


def _code(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code(), caught.value.details() or ""


def test_a_job_token_is_worth_its_job_and_nothing_else(
    deployment: LocalDeployment, waiting_job: dict[str, Any]
) -> None:
    job, owner = waiting_job["job"], waiting_job["owner"]
    token = json.loads(Path(waiting_job["record"]).read_text())["token"]
    meta = bearer_metadata(token)
    with user_channel(deployment.endpoints("a").trainer, "trainer") as channel:
        trainer = trainer_pb2_grpc.TrainerStub(channel)
        cancel = trainer_pb2.CancelStageRequest(job_id=job.job_id)
        code, details = _code(lambda: trainer.CancelStage(cancel, metadata=meta, timeout=10))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "job token" in details
        listing = trainer_pb2.ListStagesRequest()
        assert _code(lambda: trainer.ListStages(listing, metadata=meta, timeout=10))[0] == (
            grpc.StatusCode.PERMISSION_DENIED
        )
    with user_channel(deployment.data_address("a"), "data") as channel:
        data = data_pb2_grpc.DataStub(channel)
        grant = data_pb2.GrantRequest(name="anything", grantee="someone")
        code, _ = _code(lambda: data.Grant(grant, metadata=meta, timeout=10))
        assert code == grpc.StatusCode.PERMISSION_DENIED
    # Even through a trainer's certificate, the token opens no edge of another job.
    with service_channel(deployment, "a", "switch", as_role="trainer") as channel:
        relay = relay_pb2_grpc.RelayStub(channel)
        other = relay_pb2.EdgeMessage(open=relay_pb2.EdgeOpen(job_id="someone-elses-job", edge=job.edge))
        stream = relay.OpenEdge(iter([other]), metadata=meta, timeout=10)
        code, details = _code(lambda: next(iter(stream)))
        assert code == grpc.StatusCode.PERMISSION_DENIED and job.job_id in details
    refused = _switch_audit(deployment, "a", "edge.open", "someone-elses-job")
    assert [(r["outcome"], r["account"], r["token_job"]) for r in refused] == [("refused", owner, job.job_id)]
    # The job itself is untouched.
    status = next(iter(waiting_job["session"].watch(job.job_id)))
    assert status.state in (trainer_pb2.STAGE_STATE_PENDING, trainer_pb2.STAGE_STATE_RUNNING)
