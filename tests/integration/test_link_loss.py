"""A WAN outage pauses a job and it continues by itself: nothing lost, nothing applied twice.

The job trained through a cut (with every TCP connection reset, so the switches really lose the link
and the trainers really replay) ends with exactly the parameters of the same job run without one: a
micro-batch lost or applied twice would change them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nebula_common.launcher import LocalDeployment
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.client import ClusterSession, JobHandle, submit_job
from tests.support.accounts import make_user
from tests.support.jobs import numbers_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 24
OUTAGE_S = 10.0


@pytest.fixture(scope="module")
def own_deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    run_dir: Path = tmp_path_factory.mktemp("nebula-link-loss")
    with LocalDeployment(run_dir=run_dir, bandwidth_mbit=100.0, delay_ms=5.0) as running:
        yield running


def wait_link(session: ClusterSession, up: bool, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if session.link_status().connected == up:
            return
        time.sleep(0.1)
    raise AssertionError(f"link did not become {'up' if up else 'down'} within {timeout}s")


def final_parameters(deployment: LocalDeployment, cluster: str, owner: str, job_id: str, stage: str) -> dict:
    path = deployment.run_dir / cluster / "trainer" / "accounts" / owner / "jobs" / job_id / stage
    return torch.load(path / f"step-{STEPS}" / "model.pt", weights_only=True)


def decoder_step(status: trainer_pb2.StageStatus) -> bool:
    """A running decoder's status after a completed step (one that carries that step's loss)."""
    return (
        status.stage == "decoder"
        and bool(status.steps_done)
        and status.state == trainer_pb2.STAGE_STATE_RUNNING
    )


def run_to_end(
    handle: JobHandle, on_step: Callable[[trainer_pb2.StageStatus], None] | None = None
) -> dict[int, float]:
    """Follow a job to its end; the downstream stage's loss at each step it reported."""
    losses: dict[int, float] = {}
    for update in handle.updates():
        status = update.status
        if decoder_step(status):
            losses[status.steps_done] = status.loss
        if on_step is not None:
            on_step(status)
    return losses


def test_a_wan_outage_pauses_the_job_and_it_finishes_exactly_as_without_one(
    own_deployment: LocalDeployment,
) -> None:
    a = make_user(own_deployment, "a", "alice")
    b = make_user(own_deployment, "b", "bob")
    spec = {"steps": STEPS, "data__batch_size": 32}

    calm = submit_job(numbers_job(**spec), {"a": a, "b": b})
    calm_losses = run_to_end(calm)
    assert {s.state for s in calm.final.values()} == {trainer_pb2.STAGE_STATE_SUCCEEDED}, calm.final

    wan = own_deployment.wan
    cut: dict[str, float] = {}

    def cut_after_a_few_steps(status: trainer_pb2.StageStatus) -> None:
        if not cut and status.steps_done >= 3:
            cut["at"] = time.monotonic()
            wan.cut()
            wan.reset_connections()  # the switches lose the link at once; frames in flight are gone

    stormy = submit_job(numbers_job(**spec), {"a": a, "b": b})
    updates = stormy.updates()
    losses: dict[int, float] = {}
    for update in updates:
        status = update.status
        if decoder_step(status):
            losses[status.steps_done] = status.loss
        cut_after_a_few_steps(status)
        if cut:
            break
    wait_link(a, up=False)
    assert stormy.final == {}, f"a stage ended during the outage: {stormy.final}"
    remaining = OUTAGE_S - (time.monotonic() - cut["at"])
    if remaining > 0:
        time.sleep(remaining)  # the outage itself: what is under test is that nothing ends during it
    assert stormy.final == {}, f"a stage ended during the outage: {stormy.final}"
    wan.restore()
    for update in updates:
        status = update.status
        if decoder_step(status):
            losses[status.steps_done] = status.loss

    assert {s.state for s in stormy.final.values()} == {trainer_pb2.STAGE_STATE_SUCCEEDED}, stormy.final
    for step in sorted(set(losses) & set(calm_losses)):
        assert losses[step] == pytest.approx(calm_losses[step], rel=1e-5, abs=1e-6), step
    for cluster, owner, stage in (("a", "alice", "encoder"), ("b", "bob", "decoder")):
        expected = final_parameters(own_deployment, cluster, owner, calm.job.job_id, stage)
        got = final_parameters(own_deployment, cluster, owner, stormy.job.job_id, stage)
        assert expected.keys() == got.keys()
        for name in expected:
            assert torch.allclose(got[name], expected[name], rtol=1e-5, atol=1e-6), f"{stage}.{name} differs"


def test_wan_port_refuses_plaintext(own_deployment: LocalDeployment) -> None:
    wan = f"127.0.0.1:{own_deployment.cluster_state['b'].switch.info['wan_port']}"
    with grpc.insecure_channel(wan) as channel, pytest.raises(grpc.RpcError) as refused:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
