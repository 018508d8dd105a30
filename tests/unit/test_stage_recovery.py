"""Stage recovery on the in-memory edge: epochs, RESUME, restart from the common checkpoint.

Both stages of a built-in job run as real ``ProgramRunner``s in threads of this process on a
``MemoryLink`` that applies the switches' epoch rules. A stage whose process "dies" (its edge
end vanishes without a close) is started again with ``epoch=1`` on the same data dir; an
outage past ``max_outage_s`` makes both stages recover by themselves once the link is back.
Either way the job must end exactly like an uninterrupted run (codec none, fixed seed: the
same per-step losses and bit-identical final parameters).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from nebula_common.jobspec import load_spec
from nebula_common.jobspec.builtin import builtin_spec
from nebula_common.proto.nebula.v1 import relay_pb2, trainer_pb2
from nebula_common.sdk.jobs import ProgramJob
from services.trainer.edge import EdgeConnection, EdgeSettings, stage_edge
from services.trainer.edge.memory import MemoryLink, MemoryTransport
from services.trainer.edge.session import TransportHandler
from tests.support.edges import (
    StageRun,
    SwitchPair,
    finish,
    run_stages,
    stage_runner,
    wait_for,
    wait_for_step,
)
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
    if isinstance(transport, MemoryTransport):
        transport.vanish()
    else:  # a gRPC stream cancelled without a close, as when the process dies
        transport.shutdown()
    run.runner.cancel()  # the "dead" runner's thread must not train on (its close goes nowhere)
    finish(run, 30)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[StageRun, StageRun]:
    runs = run_stages(small_numbers(), tmp_path_factory.mktemp("ref"), MemoryLink(), SETTINGS)
    assert [r.final.state for r in runs] == [SUCCEEDED, SUCCEEDED], [r.final.message for r in runs]
    return runs


@pytest.mark.parametrize(
    ("dead", "edge"),
    [(0, "memory"), (1, "memory"), (1, "grpc")],
    ids=["upstream-restarts", "downstream-restarts", "downstream-restarts-grpc"],
)
def test_a_restarted_stage_rejoins_at_the_common_checkpoint_and_the_job_ends_as_uninterrupted(
    reference: tuple[StageRun, StageRun], tmp_path: Path, dead: int, edge: str, request: pytest.FixtureRequest
) -> None:
    job = small_numbers()
    link: MemoryLink | SwitchPair = MemoryLink() if edge == "memory" else request.getfixturevalue("switches")
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
    assert len(resumed) == 1 and resumed.pop() >= 2  # a checkpoint both held, not the job's start
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
    assert runs[1].epochs == [0, 1] and restarted.final.resumed_from_step >= 2


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


class SwitchDown:
    """A transport to this cluster's switch while it is down: the open is never answered."""

    def __init__(self) -> None:
        self.shut = False

    def start(self, handler: TransportHandler) -> None:
        """Nothing answers."""

    def send(self, message: relay_pb2.EdgeMessage) -> None:
        """Lost: there is no stream."""

    def close(self, reason: str, error: bool) -> None:
        """Nothing to close."""

    def wait_close_sent(self, timeout: float) -> None:
        """Nothing was sent."""

    def shutdown(self) -> None:
        self.shut = True


def switch_down_first(run: StageRun, opens: int) -> list[SwitchDown]:
    """Make ``run``'s first ``opens`` opens of an epoch > 0 meet a switch that is down."""
    downs: list[SwitchDown] = []
    factory = run.runner.edge_factory

    def open_edge(spec: trainer_pb2.StageSpec, settings: EdgeSettings, epoch: int) -> EdgeConnection:
        if epoch > 0 and len(downs) < opens:
            downs.append(SwitchDown())
            return stage_edge(spec, downs[-1], settings, epoch)
        return factory(spec, settings, epoch)

    run.runner.edge_factory = open_edge
    return downs


def test_a_recovering_stage_whose_switch_is_down_keeps_opening_until_it_answers(
    reference: tuple[StageRun, StageRun], tmp_path: Path
) -> None:
    job, link = small_numbers(), MemoryLink()
    runs = [stage_runner(job, index, tmp_path, link, SETTINGS) for index in (0, 1)]
    for run in runs:
        run.runner.start()
    wait_for_step(runs[1], 3)
    vanish(runs[1])
    quick = dataclasses.replace(SETTINGS, ready_timeout_s=0.2)
    restarted = stage_runner(job, 1, tmp_path, link, quick, epoch=1)
    downs = switch_down_first(restarted, 2)
    restarted.runner.start()
    for run in (runs[0], restarted):
        finish(run, 120)
    check_same_as(reference, (runs[0], restarted))
    assert len(downs) == 2 and all(down.shut for down in downs)  # each failed open was shut, not leaked
    assert any("waiting for this cluster's switch" in s.message for s in restarted.board)
    assert restarted.runner.recoveries == 0  # waiting for the switch is not another recovery


def test_a_cancel_while_the_switch_is_down_ends_cancelled(tmp_path: Path) -> None:
    quick = dataclasses.replace(SETTINGS, ready_timeout_s=0.2)
    restarted = stage_runner(small_numbers(), 1, tmp_path, MemoryLink(), quick, epoch=1)
    downs = switch_down_first(restarted, 1_000_000)
    restarted.runner.start()
    wait_for(lambda: len(downs) >= 2, 30, "the switch to be tried twice")
    restarted.runner.cancel()
    finish(restarted, 10)
    assert restarted.final.state == trainer_pb2.STAGE_STATE_CANCELLED, restarted.final.message


def test_a_stage_restarted_after_its_job_finished_ends_succeeded_when_the_peer_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after its last step (e.g. while closing the edge), restarted once the other stage had
    finished: nobody answers its RESUME, and since it holds its final checkpoint it ends SUCCEEDED with
    the reason instead of waiting START_TIMEOUT_S and reporting a finished job as failed."""
    from services.trainer.runtime import resume

    monkeypatch.setattr(resume, "PEER_FINISHED_AFTER_S", 1.0)
    job = small_numbers()
    link = MemoryLink()
    runs = run_stages(job, tmp_path, link, SETTINGS)
    assert [r.final.state for r in runs] == [SUCCEEDED, SUCCEEDED]
    restarted = stage_runner(job, 0, tmp_path, link, SETTINGS, epoch=1)
    restarted.runner.start()
    finish(restarted, 60)
    assert restarted.final.state == SUCCEEDED, restarted.final.message
    assert restarted.final.steps_done == STEPS
    assert "had finished" in restarted.final.message, restarted.final.message


def test_a_restarted_stage_without_its_final_checkpoint_still_waits_for_the_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a stage that did every step may conclude the job finished: one that did not keeps waiting."""
    from services.trainer.runtime import resume

    monkeypatch.setattr(resume, "PEER_FINISHED_AFTER_S", 0.5)
    monkeypatch.setattr(resume, "START_TIMEOUT_S", 2.0)  # how long it waits for the peer's RESUME
    job = small_numbers()
    restarted = stage_runner(job, 0, tmp_path, MemoryLink(), SETTINGS, epoch=1)
    restarted.runner.start()
    finish(restarted, 60)
    assert restarted.final.state == trainer_pb2.STAGE_STATE_FAILED, restarted.final.message
    assert "RESUME" in restarted.final.message, restarted.final.message
