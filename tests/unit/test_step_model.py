"""The pipelined step model replays the trainers' schedules: compute and the link overlap."""

from __future__ import annotations

import pytest

from nebula_common.sdk.step_model import EdgeLoad, Pipeline, StageTimes, step_seconds

UNIT = StageTimes(upstream_forward=1.0, upstream_backward=1.0, downstream=1.0)
NOTHING = EdgeLoad(forward_bytes=0, backward_bytes=0)
GPIPE_2 = Pipeline(micro_batches=2, schedule="gpipe")


def test_without_a_link_the_busiest_stage_sets_the_step() -> None:
    # Upstream: F0 [0,1] F1 [1,2]; downstream: 0 [1,2], 1 [2,3]; B0 [2,3], B1 [3,4].
    assert step_seconds(UNIT, NOTHING, 1e12, 0.0, GPIPE_2) == pytest.approx(4.0)
    slow_downstream = StageTimes(1.0, 1.0, 3.0)  # 0 [1,4], 1 [4,7]; B0 [4,5], B1 [7,8]
    assert step_seconds(slow_downstream, NOTHING, 1e12, 0.0, GPIPE_2) == pytest.approx(8.0)


def test_the_link_overlaps_instead_of_adding() -> None:
    """One second of wire per frame each way and no compute: 3 s, where compute + transfer says 4."""
    free = StageTimes(0.0, 0.0, 0.0)
    second = EdgeLoad(forward_bytes=1000, backward_bytes=1000)  # 8,000 bit at 8,000 bit/s
    assert step_seconds(free, second, 8000.0, 0.0, GPIPE_2) == pytest.approx(3.0)
    # Half the RTT of latency on each crossing, once per direction on the critical path.
    assert step_seconds(free, second, 8000.0, 0.2, GPIPE_2) == pytest.approx(3.2)


def test_codec_seconds_count_on_the_side_that_runs_them() -> None:
    coded = EdgeLoad(0, 0, encode_forward=0.5, decode_forward=0.25, encode_backward=0.25, decode_backward=0.5)
    plain = step_seconds(UNIT, NOTHING, 1e12, 0.0, GPIPE_2)
    assert step_seconds(UNIT, coded, 1e12, 0.0, GPIPE_2) > plain + 1.0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_fewer_bytes_never_predict_a_slower_step(schedule: str) -> None:
    pipeline = Pipeline(micro_batches=4, schedule=schedule, max_in_flight=2)
    stages = StageTimes(0.01, 0.02, 0.03)
    previous = None
    for size in (10_000_000, 1_000_000, 100_000, 10_000, 0):
        seconds = step_seconds(stages, EdgeLoad(size, size), 20e6, 0.04, pipeline)
        assert previous is None or seconds <= previous
        previous = seconds
    # With nothing to send the step is the compute's plus at least one RTT (gpipe: exactly one, waiting
    # for the first gradient; 1F1B with two in flight waits again for later ones).
    compute_only = step_seconds(stages, NOTHING, 1e15, 0.0, pipeline)
    assert previous >= compute_only + 0.04 - 1e-9
    if schedule == "gpipe":
        assert previous == pytest.approx(compute_only + 0.04)


def test_an_impossible_link_is_refused() -> None:
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        step_seconds(UNIT, NOTHING, 0.0, 0.0, GPIPE_2)
