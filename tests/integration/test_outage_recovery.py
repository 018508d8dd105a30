"""A WAN outage longer than the trainers' limit: the stages give up their attempt, say why, and resume.

Real processes under the local launcher, with the trainers' outage limit
(``NEBULA_TRAINER_EDGE_MAX_OUTAGE_S``) set to a few seconds. The WAN is cut (every connection reset)
for longer than that: both stages must report RECOVERING with a message naming the outage, and when
the link returns both restart by themselves from the last checkpoint they both hold, at the next
epoch. The job then ends exactly as the same job without a fault (codec none, fixed seed): every
per-step loss (re-run steps included) and both stages' final parameters bit-identical.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from nebula_common.launcher import LocalDeployment
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.client import ClusterSession, JobHandle, submit_job
from tests.support.accounts import make_user
from tests.support.jobs import numbers_job

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.timeout(300)]

MAX_OUTAGE_S = 3.0
STEPS = 24
CHECKPOINT_INTERVAL = 4
CUT_AT_STEP = 6  # past the checkpoint at 4: the stages resume from it, not from step 0
RECOVERING_WITHIN_S = 60.0  # the limit plus a loaded machine's slack
STAGES = (("a", "alice", "encoder"), ("b", "bob", "decoder"))
SPEC = {"steps": STEPS, "data__batch_size": 32, "checkpoint__interval": CHECKPOINT_INTERVAL}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    run_dir: Path = tmp_path_factory.mktemp("nebula-outage")
    with pytest.MonkeyPatch.context() as env:
        # The launched trainers inherit this process's environment.
        env.setenv("NEBULA_TRAINER_EDGE_MAX_OUTAGE_S", str(MAX_OUTAGE_S))
        with LocalDeployment(run_dir=run_dir, bandwidth_mbit=100.0, delay_ms=5.0) as running:
            yield running


@pytest.fixture(scope="module")
def sessions(deployment: LocalDeployment) -> dict[str, ClusterSession]:
    return {"a": make_user(deployment, "a", "alice"), "b": make_user(deployment, "b", "bob")}


def losses_of(handle: JobHandle, on_status: object = None) -> dict[int, float]:
    """Follow the job to its end (it must succeed); the decoder's loss of every step it reported."""
    losses: dict[int, float] = {}
    for update in handle.updates():
        status = update.status
        if status.stage == "decoder" and status.steps_done and status.HasField("loss"):
            losses[status.steps_done] = status.loss
        if callable(on_status):
            on_status(status)
    states = {stage: status.state for stage, status in handle.final.items()}
    assert set(states.values()) == {trainer_pb2.STAGE_STATE_SUCCEEDED}, handle.final
    return losses


def final_parameters(deployment: LocalDeployment, job_id: str, cluster: str, owner: str, stage: str) -> dict:
    path = deployment.run_dir / cluster / "trainer" / "accounts" / owner / "jobs" / job_id / stage
    return torch.load(path / f"step-{STEPS}" / "model.pt", weights_only=True)


def test_an_outage_past_the_limit_recovers_from_the_common_checkpoint_by_itself(
    deployment: LocalDeployment, sessions: dict[str, ClusterSession]
) -> None:
    calm_handle = submit_job(numbers_job(**SPEC), sessions)
    calm = losses_of(calm_handle)

    wan = deployment.wan
    handle = submit_job(numbers_job(**SPEC), sessions)
    cut: dict[str, float] = {}
    recovering: dict[str, trainer_pb2.StageStatus] = {}
    restored = threading.Event()

    def restore_anyway() -> None:
        """A safety net: the link comes back after the deadline even if the stages never gave up."""
        if not restored.wait(RECOVERING_WITHIN_S):
            wan.restore()

    def on_status(status: trainer_pb2.StageStatus) -> None:
        if status.state == trainer_pb2.STAGE_STATE_RECOVERING and status.stage not in recovering:
            recovering[status.stage] = status
            if len(recovering) == 2 and cut and not restored.is_set():
                cut["restored_after"] = time.monotonic() - cut["at"]
                wan.restore()  # both stages gave up their attempt: bring the link back
                restored.set()
        if cut or status.stage != "decoder" or status.steps_done < CUT_AT_STEP:
            return
        cut["at"] = time.monotonic()
        wan.cut()
        wan.reset_connections()
        threading.Thread(target=restore_anyway, daemon=True).start()

    stormy = losses_of(handle, on_status)
    assert cut, "the job ended before the cut"
    assert restored.is_set(), (
        f"both stages were not RECOVERING {RECOVERING_WITHIN_S:.0f} s into a cut longer than their "
        f"{MAX_OUTAGE_S} s outage limit: {recovering}"
    )
    assert cut["restored_after"] >= MAX_OUTAGE_S, cut
    for status in recovering.values():
        assert "down" in status.message and "checkpoint" in status.message, status.message
    final = handle.final
    assert {status.epoch for status in final.values()} == {1}, final
    # Both from the same checkpoint, after the first (the cut came at step CUT_AT_STEP or a little later).
    resumed = {status.resumed_from_step for status in final.values()}
    assert len(resumed) == 1 and min(resumed) >= CHECKPOINT_INTERVAL, final
    assert min(resumed) % CHECKPOINT_INTERVAL == 0, final

    assert set(stormy) == set(calm)
    for step, loss in calm.items():
        assert stormy[step] == loss, f"step {step}: {stormy[step]} != {loss}"
    for cluster, owner, stage in STAGES:
        expected = final_parameters(deployment, calm_handle.job.job_id, cluster, owner, stage)
        got = final_parameters(deployment, handle.job.job_id, cluster, owner, stage)
        assert expected.keys() == got.keys()
        for name in expected:
            assert torch.equal(got[name], expected[name]), f"{stage}.{name} differs"
