"""1F1B's window from the measured round trip: it grows with the RTT, never changes what is trained.

``covering_window`` on its own (the arithmetic and its bounds), then real stages (``ProgramRunner``,
the built-in numbers job) on an in-memory edge pair whose link holds every item a fixed one-way
delay: each step's window is ``covering_window`` of what the step before measured, the measured
latency holds the round trip, across a long one the upstream runs as many activations ahead as the
job allows (every micro-batch of the step, up to ``max_in_flight``), and either way its losses and
parameters are bit for bit those of GPipe.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer.edge import EdgeSettings
from services.trainer.edge.memory import MemoryLink
from services.trainer.runtime.schedule import covering_window, peak_in_flight, upstream_ops
from tests.support.edges import StageRun, run_stages
from tests.support.jobs import numbers_job

pytestmark = pytest.mark.timeout(300)

SETTINGS = EdgeSettings(window_bytes=1 << 20, max_outage_s=20.0, retransmit_s=5.0, ready_timeout_s=30)
STEPS = 5
MICRO_BATCHES = 16
RTT = 1.5  # seconds: the far link's round trip


def test_the_window_covers_the_gradient_latency_with_compute() -> None:
    # (window - 1) x compute per micro-batch >= latency: 40 ms at 10 ms per micro-batch needs 5.
    assert covering_window(0.040, 0.010, cap=16, micro_batches=16) == 5
    assert covering_window(0.041, 0.010, cap=16, micro_batches=16) == 6
    windows = [covering_window(rtt, 0.013, cap=64, micro_batches=64) for rtt in (0.0, 0.02, 0.04, 0.08, 0.16)]
    assert windows == sorted(windows) and windows[0] < windows[-1]  # grows with the round trip
    assert covering_window(0.0, 0.010, cap=16, micro_batches=16) == 2  # at least 2 where allowed


def test_the_window_is_bounded_by_max_in_flight_and_the_step() -> None:
    assert covering_window(10.0, 0.001, cap=4, micro_batches=16) == 4  # the memory the job allows
    assert covering_window(10.0, 0.001, cap=16, micro_batches=8) == 8  # no more than the step has
    assert covering_window(0.0, 0.010, cap=1, micro_batches=8) == 1
    assert covering_window(0.5, 0.0, cap=6, micro_batches=8) == 6  # compute not measured yet: the cap
    for window in (1, 3, 8):
        assert peak_in_flight(upstream_ops("1f1b", 8, window)) == window
    with pytest.raises(ValueError, match="cap and micro_batches"):
        covering_window(0.1, 0.01, cap=0, micro_batches=8)
    with pytest.raises(ValueError, match=">= 0 seconds"):
        covering_window(-0.1, 0.01, cap=4, micro_batches=8)


def job(schedule: str):  # noqa: ANN201
    return numbers_job(
        steps=STEPS,
        data__batch_size=4 * MICRO_BATCHES,
        data__micro_batches=MICRO_BATCHES,
        pipeline__schedule=schedule,
        pipeline__max_in_flight=MICRO_BATCHES,
        stages__0__options__d_model=32,
        stages__1__options__d_model=32,
    )


def assert_same_training(reference: tuple[StageRun, StageRun], run: tuple[StageRun, StageRun]) -> None:
    for ref, got in zip(reference, run, strict=True):
        assert got.final.state == trainer_pb2.STAGE_STATE_SUCCEEDED, got.final.message
        assert got.received == ref.received
        for ours, theirs in zip(got.parameters(), ref.parameters(), strict=True):
            assert torch.equal(ours, theirs)
    assert run[1].losses() == reference[1].losses()  # exactly
    assert sorted(run[1].losses()) == list(range(STEPS))


@pytest.mark.long  # two schedules over a slow link (`make test-faults`)
def test_the_1f1b_window_grows_with_the_round_trip_and_trains_bit_identical_to_gpipe(tmp_path: Path) -> None:
    gpipe = run_stages(job("gpipe"), tmp_path / "gpipe", MemoryLink(), SETTINGS, receive_ahead=4)
    near = run_stages(job("1f1b"), tmp_path / "near", MemoryLink(), SETTINGS, receive_ahead=4)
    # A 1.5 s round trip against a few ms of compute per micro-batch (4 rows at d_model 32).
    far = run_stages(job("1f1b"), tmp_path / "far", MemoryLink(delay_s=RTT / 2), SETTINGS, receive_ahead=4)
    assert_same_training(gpipe, near)
    assert_same_training(gpipe, far)
    for run in (near, far):
        runner = run[0].runner
        assert len(runner.windows) == STEPS and len(runner.window_inputs) == STEPS
        # Step 0 has nothing measured: the job's max_in_flight; each later step the window its
        # predecessor measured (the latency's smallest micro-batch, compute per micro-batch).
        assert runner.windows[0] == MICRO_BATCHES
        expected = [
            covering_window(lat, comp, MICRO_BATCHES, MICRO_BATCHES) for lat, comp in runner.window_inputs
        ]
        assert runner.windows[1:] == expected[:-1]
    near_latency = [lat for lat, _ in near[0].runner.window_inputs]
    far_latency = [lat for lat, _ in far[0].runner.window_inputs]
    # The measured latency holds the round trip, so (with the arithmetic above) the window grows
    # with it. Compute per micro-batch is wall time on a shared machine (a starved stage computes
    # slower and needs fewer ahead), so how many the far run needs is not asserted as a number.
    assert statistics.median(near_latency) < RTT <= min(far_latency)
    inputs = far[0].runner.window_inputs
    for (latency, compute), window in zip(inputs, far[0].runner.windows[1:], strict=False):
        assert window >= min(MICRO_BATCHES, 1 + int(RTT / compute)), (latency, compute, window)
    assert gpipe[0].runner.windows == [MICRO_BATCHES] * STEPS  # GPipe holds every micro-batch anyway
    assert gpipe[0].runner.window_inputs == []  # and measures nothing for it
