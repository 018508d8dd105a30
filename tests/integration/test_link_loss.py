"""WAN outages and killed switches pause a job; it continues by itself, nothing lost or applied twice.

Each job here ends with exactly the parameters (and per-step losses) of the same job run without a
fault: a micro-batch lost or applied twice would change them. The outage resets every connection, so
the switches really lose the link and the trainers really replay; a killed switch is restarted by the
launcher's supervisor and its trainers reconnect to it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nebula_common.errors import NebulaError
from nebula_common.launcher import LocalDeployment
from nebula_common.proto.nebula.v1 import relay_pb2, trainer_pb2
from nebula_common.sdk.client import ClusterSession, JobHandle, submit_job
from nebula_common.wan.control import WanControl, WanControlError
from tests.support.accounts import make_user
from tests.support.jobs import numbers_job

# A hang guard, not a performance bound. The first test's budget also pays for the module's own
# deployment start and the calm reference job (its fixtures): measured at load 25, 128 s + 15 s before
# the outage job even begins. With 300 s, a busier machine leaves too little, and the likeliest way the
# outage callback once raised in CI is this timeout firing inside it (the WAN then stayed cut; now it is
# restored in a finally either way, and the link waits name what they saw).
pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.timeout(600)]

STEPS = 40
OUTAGE_S = 10.0
LINK_CHANGE_S = 60.0  # the switch notices a reset link in well under a second; a machine at load 20+
# may take seconds more, and a tight deadline here failed the test instead of the product
SPEC = {"steps": STEPS, "data__batch_size": 32}
STAGES = (("a", "alice", "encoder"), ("b", "bob", "decoder"))


@dataclass
class Run:
    job_id: str
    losses: dict[int, float]


@pytest.fixture(scope="module")
def own_deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    run_dir: Path = tmp_path_factory.mktemp("nebula-link-loss")
    started = time.monotonic()
    with LocalDeployment(run_dir=run_dir, bandwidth_mbit=100.0, delay_ms=5.0) as running:
        print(f"deployment started: {time.monotonic() - started:.1f} s")
        yield running


@pytest.fixture(scope="module")
def sessions(own_deployment: LocalDeployment) -> dict[str, ClusterSession]:
    return {"a": make_user(own_deployment, "a", "alice"), "b": make_user(own_deployment, "b", "bob")}


@pytest.fixture(scope="module")
def calm(sessions: dict[str, ClusterSession]) -> Run:
    """The reference: the same job with no fault."""
    started = time.monotonic()
    handle = submit_job(numbers_job(**SPEC), sessions)
    run = follow(handle, lambda status: None)
    print(f"calm job: {time.monotonic() - started:.1f} s")
    return run


def follow(handle: JobHandle, on_status: Callable[[trainer_pb2.StageStatus], None]) -> Run:
    """Follow a job to its end, calling ``on_status`` on every update; it must succeed."""
    losses: dict[int, float] = {}
    for update in handle.updates():
        status = update.status
        if (
            status.stage == "decoder"
            and status.steps_done
            and status.state == trainer_pb2.STAGE_STATE_RUNNING
        ):
            losses[status.steps_done] = status.loss
        on_status(status)
    states = {stage: status.state for stage, status in handle.final.items()}
    assert set(states.values()) == {trainer_pb2.STAGE_STATE_SUCCEEDED}, handle.final
    return Run(handle.job.job_id, losses)


def final_parameters(deployment: LocalDeployment, job_id: str, cluster: str, owner: str, stage: str) -> dict:
    path = deployment.run_dir / cluster / "trainer" / "accounts" / owner / "jobs" / job_id / stage
    return torch.load(path / f"step-{STEPS}" / "model.pt", weights_only=True)


def assert_same_training(deployment: LocalDeployment, calm: Run, faulty: Run) -> None:
    for step in sorted(set(faulty.losses) & set(calm.losses)):
        assert faulty.losses[step] == pytest.approx(calm.losses[step], rel=1e-5, abs=1e-6), step
    for cluster, owner, stage in STAGES:
        expected = final_parameters(deployment, calm.job_id, cluster, owner, stage)
        got = final_parameters(deployment, faulty.job_id, cluster, owner, stage)
        assert expected.keys() == got.keys()
        for name in expected:
            assert torch.allclose(got[name], expected[name], rtol=1e-5, atol=1e-6), f"{stage}.{name} differs"


def ask_link(session: ClusterSession) -> tuple[relay_pb2.LinkStatus | None, str]:
    """The switch's link status, or None and why not (a loaded switch may miss one call's deadline)."""
    try:
        link = session.link_status()
    except NebulaError as exc:
        return None, f"error: {exc}"
    return link, f"connected={link.connected} link_sessions={link.link_sessions} role={link.link_role!r}"


def wait_link(session: ClusterSession, up: bool, timeout: float = LINK_CHANGE_S) -> float:
    """Wait until the switch reports its WAN link ``up`` (or down); the seconds it took.

    A failure names what was seen last (the switch's link status or the error asking for it).
    """
    started = time.monotonic()
    deadline = started + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        link, last = ask_link(session)
        if link is not None and link.connected == up:
            return time.monotonic() - started
        time.sleep(0.1)
    raise AssertionError(
        f"the WAN link of cluster {session.endpoints.cluster_id} did not go {'up' if up else 'down'} "
        f"within {timeout:.0f} s; last seen: {last}"
    )


def restore_wan(wan: WanControl, timeout: float = 30.0) -> None:
    """End a cut for sure: a control call a loaded emulator did not answer in time is repeated."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if not wan.restore()["cut"]:
                return
            problem = "the emulator still reports the link cut"
        except WanControlError as exc:
            problem = str(exc)
        if time.monotonic() > deadline:
            raise AssertionError(f"could not restore the WAN within {timeout:.0f} s: {problem}")
        time.sleep(0.5)


@pytest.fixture(autouse=True)
def wan_restored(own_deployment: LocalDeployment) -> Iterator[None]:
    """Every test starts and ends with the WAN up: a test that fails mid-outage must not leave the
    link cut for the next one (it would wait out its whole timeout instead of failing on its own)."""
    restore_wan(own_deployment.wan)
    yield
    restore_wan(own_deployment.wan)


def test_a_wan_outage_pauses_the_job_and_it_finishes_exactly_as_without_one(
    own_deployment: LocalDeployment, sessions: dict[str, ClusterSession], calm: Run
) -> None:
    wan = own_deployment.wan
    started = time.monotonic()
    handle = submit_job(numbers_job(**SPEC), sessions)
    cut: dict[str, float] = {}

    def outage(status: trainer_pb2.StageStatus) -> None:
        if cut or status.steps_done < 3:
            return
        cut["at"] = time.monotonic()
        try:
            wan.cut()
            cut["reset"] = wan.reset_connections()  # the switches lose the link at once; in flight: gone
            cut["down_after_s"] = wait_link(sessions["a"], up=False)
            # The outage lasts OUTAGE_S from the moment the switches saw the link go, however long a
            # loaded machine took to notice; the link must stay down all along (nothing passes a cut).
            down_at = time.monotonic()
            while (left := OUTAGE_S - (time.monotonic() - down_at)) > 0:
                link, seen = ask_link(sessions["a"])
                assert link is None or not link.connected, (
                    f"the WAN link came back {time.monotonic() - down_at:.1f} s into the cut: {seen}"
                )
                time.sleep(min(left, 0.5))
        finally:
            restore_wan(wan)  # whatever failed above: never leave the link cut
        cut["restored_after_s"] = time.monotonic() - cut["at"]

    stormy = follow(handle, outage)
    assert cut, "the job ended before the outage"
    assert cut["reset"] >= 1, f"the outage reset no connection: {cut}"
    assert cut["restored_after_s"] >= OUTAGE_S, cut
    # How long a loaded machine took (shown with -rP):
    print(f"outage job: {time.monotonic() - started:.1f} s; outage: {cut}")
    assert_same_training(own_deployment, calm, stormy)


def test_killed_services_are_restarted_and_the_job_finishes_exactly_as_without_them(
    own_deployment: LocalDeployment, sessions: dict[str, ClusterSession], calm: Run
) -> None:
    killed: list[str] = []
    # The dialer's switch, two services the running job does not need, then the acceptor's switch.
    plan = {3: "switch-a", 8: "codec-a", 10: "auth-b", 20: "switch-b"}

    def kill(status: trainer_pb2.StageStatus) -> None:
        for at_step, name in plan.items():
            if status.steps_done >= at_step and name not in killed:
                killed.append(name)
                os.kill(own_deployment.process(name).pid, signal.SIGKILL)  # type: ignore[arg-type]

    restarted = follow(submit_job(numbers_job(**SPEC), sessions), kill)
    assert killed == list(plan.values()), f"the job ended before every kill: {killed}"
    assert own_deployment.supervisor is not None
    assert {own_deployment.supervisor.restarts(name) >= 1 for name in killed} == {True}
    assert_same_training(own_deployment, calm, restarted)


def test_wan_port_refuses_plaintext(own_deployment: LocalDeployment) -> None:
    wan = f"127.0.0.1:{own_deployment.cluster_state['b'].switch.info['wan_port']}"
    with grpc.insecure_channel(wan) as channel, pytest.raises(grpc.RpcError) as refused:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
