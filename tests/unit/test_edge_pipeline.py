"""The pipeline loop over an in-memory edge pair: outages and lost items change nothing in training.

Both stages of a built-in job run as real ``ProgramRunner``s in threads of this process. A run
with a link cut and restore in the middle, or with items lost at random, must train exactly like
an uninterrupted run (same per-step losses, same final parameters), apply every micro-batch
once, and keep stateful codecs consistent; an outage beyond ``max_outage_s`` with no recoveries
left fails both stages with a clear reason.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer.edge import EdgeSettings
from services.trainer.edge.memory import MemoryLink
from tests.support.edges import StageRun, run_stages, wait_for, wait_for_step
from tests.support.jobs import numbers_job

pytestmark = pytest.mark.timeout(300)

SETTINGS = EdgeSettings(window_bytes=1 << 20, max_outage_s=20.0, retransmit_s=0.3, ready_timeout_s=30)
STEPS = 6
SUCCEEDED = trainer_pb2.STAGE_STATE_SUCCEEDED


def small_numbers(forward: str = "none", backward: str = "none", **overrides: object):  # noqa: ANN201
    return numbers_job(
        steps=STEPS,
        data__batch_size=16,
        data__micro_batches=2,
        stages__0__options__d_model=32,
        stages__1__options__d_model=32,
        edges__0__codec__forward=forward,
        edges__0__codec__backward=backward,
        **overrides,
    )


def expected_received(steps: int, micro_batches: int) -> list[tuple[int, int]]:
    return [(step, mb) for step in range(steps) for mb in range(micro_batches)]


def cut_and_restore(
    at_step: int | None, outage_s: float = 0.5
) -> Callable[[StageRun, StageRun, MemoryLink], None]:
    """After ``at_step``, cut the link mid-tensor (items in flight are lost), restore it later. With
    ``at_step`` None the test set the cut before the run (``MemoryLink.cut_after``): a stage that need
    not wait for its peer may have sent all it had by the time it reports a step."""

    def during(up: StageRun, down: StageRun, link: MemoryLink) -> None:
        if at_step is not None:
            wait_for_step(up, at_step)
            link.cut_after(3)
        ends = (up, down)
        wait_for(
            lambda: all(run.runner.edge is not None and not run.runner.edge.session.link_up for run in ends),
            30,
            "both ends to see the link down",
        )
        # Each end counts its outage from when it saw the link go down, which may differ by a poll.
        wait_for(
            lambda: all(run.runner.edge.session.outage_seconds() >= outage_s for run in ends),  # type: ignore[union-attr]
            30,
            "the outage to last at both ends",
        )
        link.restore()

    return during


def check_same_training(reference: tuple[StageRun, StageRun], run: tuple[StageRun, StageRun]) -> None:
    for ref, got in zip(reference, run, strict=True):
        assert got.final.state == SUCCEEDED, got.final.message
        assert got.received == ref.received  # every micro-batch (and gradient) applied exactly once, in order
        for ours, theirs in zip(got.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    ref_losses, losses = reference[1].losses(), run[1].losses()
    assert sorted(losses) == list(range(STEPS))
    for step in range(STEPS):
        assert losses[step] == pytest.approx(ref_losses[step], abs=1e-5), step


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[StageRun, StageRun]:
    """The uninterrupted run every faulty one must reproduce."""
    runs = run_stages(small_numbers(), tmp_path_factory.mktemp("ref"), MemoryLink(), SETTINGS)
    assert [r.final.state for r in runs] == [SUCCEEDED, SUCCEEDED], [r.final.message for r in runs]
    assert runs[0].received == expected_received(STEPS, 2)  # the upstream gets each gradient once
    assert runs[1].received == expected_received(STEPS, 2)  # the downstream each activation once
    return runs


def test_a_cut_and_restore_mid_run_trains_exactly_like_no_cut(
    reference: tuple[StageRun, StageRun], tmp_path: Path
) -> None:
    link = MemoryLink()
    runs = run_stages(small_numbers(), tmp_path, link, SETTINGS, during=cut_and_restore(at_step=2))
    check_same_training(reference, runs)
    assert link.dropped > 0  # the cut lost items in flight ...
    edges = [run.runner.edge for run in runs]
    assert all(edge is not None and edge.session.outage_seconds() >= 0.5 for edge in edges)
    assert (
        sum(edge.session.retransmitted_messages for edge in edges if edge) > 0
    )  # ... and they were replayed


def test_random_lost_items_are_replayed_and_train_exactly_like_none_lost(
    reference: tuple[StageRun, StageRun], tmp_path: Path
) -> None:
    link = MemoryLink(drop_probability=0.05, seed=7)
    runs = run_stages(small_numbers(), tmp_path, link, SETTINGS)
    check_same_training(reference, runs)
    assert link.dropped > 0


def test_stateful_codecs_stay_consistent_across_a_cut(tmp_path: Path) -> None:
    """Error feedback is encoded once per tensor; the replay resends the same bytes."""
    job = small_numbers(forward="ef(topk(0.1))", backward="ef(int8)")
    reference = run_stages(job, tmp_path / "ref", MemoryLink(), SETTINGS)
    cut = run_stages(job, tmp_path / "cut", MemoryLink(), SETTINGS, during=cut_and_restore(at_step=3))
    lossy = run_stages(job, tmp_path / "lossy", MemoryLink(drop_probability=0.05, seed=3), SETTINGS)
    for run in (cut, lossy):
        check_same_training(reference, run)


def test_an_outage_beyond_the_limit_without_recoveries_left_fails_both_stages_with_the_reason(
    tmp_path: Path,
) -> None:
    """With recoveries allowed the stages restart from a checkpoint instead (test_stage_recovery.py)."""
    settings = EdgeSettings(
        window_bytes=1 << 20, max_outage_s=1.0, retransmit_s=0.3, ready_timeout_s=30, max_recoveries=0
    )

    def cut_for_good(up: StageRun, down: StageRun, link: MemoryLink) -> None:
        wait_for_step(up, 2)
        link.cut("cable unplugged")

    up, down = run_stages(small_numbers(), tmp_path, MemoryLink(), settings, during=cut_for_good, timeout=60)
    for run in (up, down):
        assert run.final.state == trainer_pb2.STAGE_STATE_FAILED
        assert "gave up after 0 recoveries" in run.final.message, run.final.message
        assert "WAN link to the peer cluster down for 1 s (limit 1 s)" in run.final.message, run.final.message
    # A failed stage leaves no sender thread behind (it would hold the edge and its buffers for good).
    for run in (up, down):
        run.runner.join(30)
        sender = run.runner._sender
        assert sender is not None and not sender._thread.is_alive(), "the sender thread outlived its stage"


def test_electra_one_way_syncs_and_exact_int64_ids_on_the_memory_edge(tmp_path: Path) -> None:
    from nebula_common.jobspec import load_spec
    from nebula_common.jobspec.builtin import builtin_spec
    from nebula_common.sdk.jobs import ProgramJob

    fields = {
        "steps": 4,
        "data.batch_size": 8,
        "data.micro_batches": 2,
        "stages.0.options.d_model": 16,
        "stages.0.options.n_layers": 1,
        "stages.1.options.d_model": 16,
        "stages.1.options.n_layers": 1,
        "stages.1.replicas": 1,
    }
    job = ProgramJob(load_spec(builtin_spec("electra"), fields))
    link = MemoryLink()
    link.cut_after(5)  # mid-run, of 8 tensors: the generator sends without waiting for the sync
    up, down = run_stages(job, tmp_path, link, SETTINGS, during=cut_and_restore(at_step=None))
    for run in (up, down):
        assert run.final.state == SUCCEEDED, run.final.message
    assert down.received == expected_received(4, 2)
    assert up.received == []  # one way: only signals come back
    assert sorted(down.losses()) == [0, 1, 2, 3]
    assert sorted(up.local_losses()) == [0, 1, 2, 3]
    assert len(up.sent_tensors) == len(down.received_tensors) == 8
    for produced, received in zip(up.sent_tensors, down.received_tensors, strict=True):
        assert produced.dtype == received.dtype == torch.int64
        assert torch.equal(produced, received)
