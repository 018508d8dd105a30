"""Pipeline schedules, example order and LR schedule: what both clusters must agree on, step by step."""

from __future__ import annotations

import pytest

from nebula_common.jobspec.runtime import example_ids, lr_factor
from services.trainer.runtime.schedule import Op, downstream_ops, peak_in_flight, upstream_ops

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("micro_batches", "in_flight"), [(1, 1), (4, 2), (5, 3), (3, 8)])
def test_every_micro_batch_is_forwarded_then_backwarded_once_in_order(
    schedule: str, micro_batches: int, in_flight: int
) -> None:
    ops = upstream_ops(schedule, micro_batches, in_flight)
    forwards = [op.micro_batch for op in ops if op.kind == "F"]
    backwards = [op.micro_batch for op in ops if op.kind == "B"]
    # The edge carries activations and gradients in micro-batch order, as the receiver checks.
    assert forwards == backwards == list(range(micro_batches))
    for i in range(micro_batches):
        assert ops.index(Op("F", i)) < ops.index(Op("B", i))


def test_gpipe_holds_every_activation_and_1f1b_at_most_max_in_flight() -> None:
    assert peak_in_flight(upstream_ops("gpipe", 8, 2)) == 8
    assert peak_in_flight(upstream_ops("1f1b", 8, 2)) == 2
    assert upstream_ops("1f1b", 4, 2) == [
        Op("F", 0), Op("F", 1), Op("B", 0), Op("F", 2), Op("B", 1), Op("F", 3), Op("B", 2), Op("B", 3)
    ]  # fmt: skip


def test_downstream_returns_each_gradient_right_after_its_forward() -> None:
    assert downstream_ops(2) == [Op("F", 0), Op("B", 0), Op("F", 1), Op("B", 1)]


def test_unknown_schedule_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'"):
        upstream_ops("zigzag", 2, 2)


def test_example_order_is_shared_and_covers_each_epoch_once() -> None:
    epoch = [i for step in range(5) for mb in range(2) for i in example_ids(3, 40, step, mb, 2, 4)]
    assert sorted(epoch) == list(range(40))
    assert epoch == [i for step in range(5) for mb in range(2) for i in example_ids(3, 40, step, mb, 2, 4)]
    next_epoch = [i for mb in range(2) for i in example_ids(3, 40, 5, mb, 2, 4)]
    assert next_epoch != epoch[:8]  # a fresh permutation per epoch
    assert example_ids(4, 40, 0, 0, 2, 4) != example_ids(3, 40, 0, 0, 2, 4)


def test_lr_schedules() -> None:
    warm = lr_factor("linear_warmup", 4, 100)
    assert [warm(s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    cosine = lr_factor("cosine", 0, 10)
    assert cosine(0) == 1.0 and cosine(10) == pytest.approx(0.0) and cosine(5) == pytest.approx(0.5)
