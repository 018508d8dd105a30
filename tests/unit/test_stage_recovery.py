"""Stage recovery on the in-memory edge: epochs, RESUME, restart from the common checkpoint.

Both stages of a built-in job run as real ``ProgramRunner``s in threads of this process on a
``MemoryLink`` that applies the switches' epoch rules. A stage whose process "dies" (its edge
end vanishes without a close) is started again with ``epoch=1`` on the same data dir; an
outage past ``max_outage_s`` makes both stages recover by themselves once the link is back.
Either way the job must end exactly like an uninterrupted run (codec none, fixed seed: the
same per-step losses and bit-identical final parameters).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nebula_common.jobspec import load_spec
from nebula_common.jobspec.builtin import builtin_spec
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.jobs import ProgramJob
from services.trainer.edge import EdgeSettings
from services.trainer.edge.memory import MemoryLink, MemoryTransport
from tests.support.edges import StageRun, finish, run_stages, stage_runner, wait_for, wait_for_step
from tests.support.jobs import numbers_job

pytestmark = pytest.mark.timeout(300)

SETTINGS = EdgeSettings(window_bytes=1 << 20, max_outage_s=20.0, retransmit_s=0.3, ready_timeout_s=30)
SHORT_OUTAGE = EdgeSettings(window_bytes=1 << 20, max_outage_s=0.5, retransmit_s=0.3, ready_timeout_s=30)
STEPS = 8
SUCCEEDED = trainer_pb2.STAGE_STATE_SUCCEEDED
RECOVERING = trainer_pb2.STAGE_STATE_RECOVERING
RUNNING = trainer_pb2.STAGE_STATE_RUNNING


def small_numbers() -> ProgramJob:
    return numbers_job(
        steps=STEPS,
        data__batch_size=16,
        data__micro_batches=2,
        stages__0__options__d_model=32,
        stages__1__options__d_model=32,
        checkpoint__interval=2,
    )


def small_electra() -> ProgramJob:
    fields = {
        "steps": 6,
        "data.batch_size": 8,
        "data.micro_batches": 2,
        "stages.0.options.d_model": 16,
        "stages.0.options.n_layers": 1,
        "stages.1.options.d_model": 16,
        "stages.1.options.n_layers": 1,
        "stages.1.replicas": 1,
        "checkpoint.interval": 2,
    }
    return ProgramJob(load_spec(builtin_spec("electra"), fields))


def check_same_as(reference: tuple[StageRun, StageRun], runs: tuple[StageRun, StageRun]) -> None:
    """Both stages ended like the reference: same final parameters (bit for bit), same losses."""
    for ref, got in zip(reference, runs, strict=True):
        assert got.final.state == SUCCEEDED, got.final.message
        for ours, theirs in zip(got.parameters(), ref.parameters(), strict=True):
            assert torch.equal(ours, theirs)
        for losses, ref_losses in ((got.losses(), ref.losses()), (got.local_losses(), ref.local_losses())):
            assert bool(losses) == bool(ref_losses) and set(losses) <= set(ref_losses)
            for step, loss in losses.items():
                assert loss == ref_losses[step], step


def states(run: StageRun) -> list[int]:
    return [status.state for status in run.board]


def vanish(run: StageRun) -> None:
    """Kill the stage as a dead process would: its edge end disappears without a close, then it stops."""
    edge = run.runner.edge
    assert edge is not None
    transport = edge.session.transport
    assert isinstance(transport, MemoryTransport)
    transport.vanish()
    run.runner.cancel()  # the "dead" runner's thread must not train on (its close goes nowhere)
    finish(run, 30)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[StageRun, StageRun]:
    runs = run_stages(small_numbers(), tmp_path_factory.mktemp("ref"), MemoryLink(), SETTINGS)
    assert [r.final.state for r in runs] == [SUCCEEDED, SUCCEEDED], [r.final.message for r in runs]
    return runs


@pytest.mark.parametrize("dead", [0, 1], ids=["upstream-restarts", "downstream-restarts"])
def test_a_restarted_stage_rejoins_at_the_common_checkpoint_and_the_job_ends_as_uninterrupted(
    reference: tuple[StageRun, StageRun], tmp_path: Path, dead: int
) -> None:
    job, link = small_numbers(), MemoryLink()
    runs = [stage_runner(job, index, tmp_path, link, SETTINGS) for index in (0, 1)]
    for run in runs:
        run.runner.start()
    wait_for_step(runs[dead], 5)
    vanish(runs[dead])
    assert runs[dead].final.state == trainer_pb2.STAGE_STATE_CANCELLED
    epochs: list[int] = []
    restarted = stage_runner(job, dead, tmp_path, link, SETTINGS, epoch=1, on_epoch=epochs.append)
    restarted.runner.start()
    survivor = runs[1 - dead]
    pair = (survivor, restarted) if dead == 1 else (restarted, survivor)
    for run in pair:
        finish(run, 120)
    check_same_as(reference, pair)
    # The restarted stage began RECOVERING in epoch 1; the survivor was told and followed.
    assert states(restarted)[1] == RECOVERING and epochs == [1] and restarted.epochs == [1]
    assert RECOVERING in states(survivor) and survivor.epochs == [0, 1]
    assert "restarted" in next(s.message for s in survivor.board if s.state == RECOVERING)
    resumed = {run.final.resumed_from_step for run in pair}
    assert len(resumed) == 1 and resumed.pop() in (4, 6)  # a checkpoint both held, not step 0
    assert all(run.final.epoch == 1 for run in pair)
    # steps_done went back to the resume step when the new epoch started running.
    running = next(s for s in survivor.board if s.epoch == 1 and s.state == trainer_pb2.STAGE_STATE_RUNNING)
    assert running.steps_done == survivor.final.resumed_from_step


def test_an_outage_past_the_limit_recovers_both_stages_once_the_link_is_back(
    reference: tuple[StageRun, StageRun], tmp_path: Path
) -> None:
    def cut_for_long(up: StageRun, down: StageRun, link: MemoryLink) -> None:
        wait_for_step(up, 3)
        link.cut("cable unplugged")
        wait_for(
            lambda: all(run.final.state == RECOVERING and run.final.epoch == 1 for run in (up, down)),
            30,
            "both stages to be RECOVERING in epoch 1",
        )
        for run in (up, down):
            assert "WAN link to the peer cluster down" in run.final.message, run.final.message
            assert "resuming from the last common checkpoint" in run.final.message
        link.restore()

    runs = run_stages(small_numbers(), tmp_path, MemoryLink(), SHORT_OUTAGE, during=cut_for_long, timeout=120)
    check_same_as(reference, runs)
    for run in runs:
        assert run.epochs == [0, 1] and run.final.epoch == 1
        assert run.final.resumed_from_step in (2, 4)


def test_a_one_way_job_recovers_from_a_restarted_generator(tmp_path: Path) -> None:
    job = small_electra()
    reference = run_stages(job, tmp_path / "ref", MemoryLink(), SETTINGS)
    link = MemoryLink()
    runs = [stage_runner(job, index, tmp_path / "run", link, SETTINGS) for index in (0, 1)]
    for run in runs:
        run.runner.start()
    wait_for_step(runs[1], 3)
    vanish(runs[0])
    restarted = stage_runner(job, 0, tmp_path / "run", link, SETTINGS, epoch=1)
    restarted.runner.start()
    pair = (restarted, runs[1])
    for run in pair:
        finish(run, 120)
    check_same_as(reference, pair)
    assert runs[1].epochs == [0, 1] and restarted.final.resumed_from_step in (2, 4)


def test_a_cancel_while_recovering_ends_cancelled_at_once(tmp_path: Path) -> None:
    link = MemoryLink()
    runs = [stage_runner(small_numbers(), index, tmp_path, link, SHORT_OUTAGE) for index in (0, 1)]
    for run in runs:
        run.runner.start()
    wait_for_step(runs[0], 2)
    link.cut("cable unplugged")
    wait_for(
        lambda: all("waiting for the WAN link" in run.final.message for run in runs),
        30,
        "both stages waiting for the link in their new epoch",
    )
    for run in runs:
        assert run.final.state == RECOVERING
        run.runner.cancel()
    for run in runs:
        finish(run, 5)
        assert run.final.state == trainer_pb2.STAGE_STATE_CANCELLED, run.final.message
        assert run.runner._sender is None or not run.runner._sender._thread.is_alive()


def test_more_recoveries_than_max_recoveries_fail_with_the_reason(tmp_path: Path) -> None:
    settings = EdgeSettings(
        window_bytes=1 << 20, max_outage_s=0.5, retransmit_s=0.3, ready_timeout_s=30, max_recoveries=1
    )

    def cut_twice(up: StageRun, down: StageRun, link: MemoryLink) -> None:
        wait_for_step(up, 2)
        link.cut("first cut")
        wait_for(lambda: all(run.final.epoch == 1 for run in (up, down)), 30, "both stages in epoch 1")
        link.restore()
        wait_for(
            lambda: all(
                run.final.state == trainer_pb2.STAGE_STATE_RUNNING and run.final.epoch == 1
                for run in (up, down)
            ),
            30,
            "both stages running epoch 1",
        )
        link.cut("second cut")

    runs = run_stages(small_numbers(), tmp_path, MemoryLink(), settings, during=cut_twice, timeout=60)
    for run in runs:
        assert run.final.state == trainer_pb2.STAGE_STATE_FAILED
        assert "gave up after 1 recoveries (max_recoveries" in run.final.message, run.final.message
        assert "WAN link to the peer cluster down" in run.final.message
        assert run.runner.recoveries == 1
