"""The split advisor: the cut with the smallest activation and balanced compute, for the link given."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from torch import nn

from nebula_common.split_advice import advise_split


def _tower(widths: list[int]) -> list[nn.Module]:
    return [nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in pairwise(widths)]


def test_cuts_at_the_bottleneck_when_the_compute_around_it_is_balanced() -> None:
    layers = _tower([256, 512, 512, 16, 512, 512, 256])  # 16 wide after layer 2: the narrow waist
    advice = advise_split(layers, torch.randn(8, 256), bandwidth_mbit=60, rtt_ms=40)
    assert advice.cut.after == 2
    assert advice.cut.bytes_per_example == 16 * 4
    assert advice.cut.balance > 0.4
    assert "cut after 2:Sequential: 64 B per example cross each way" in advice.reason
    by_after = {b.after: b for b in advice.candidates}
    assert by_after[1].bytes_per_example == 512 * 4 and len(advice.candidates) == 5
    total = {b.upstream_flops + b.downstream_flops for b in advice.candidates}
    assert len(total) == 1 and total.pop() > 0  # every cut divides the same model


def test_a_fast_link_favours_balanced_compute_over_the_smallest_activation() -> None:
    # Narrowest after layer 0 (cheap), but nearly all compute comes after it.
    layers = _tower([64, 8, 1024, 1024, 1024, 1024, 64])
    example = torch.randn(32, 64)
    slow = advise_split(layers, example, bandwidth_mbit=1, rtt_ms=20)
    fast = advise_split(layers, example, bandwidth_mbit=100_000, rtt_ms=0.1, flops_per_s=1e9)
    assert slow.cut.after == 0, slow.reason  # bytes dominate on a slow link
    assert fast.cut.after != 0 and fast.cut.balance > slow.cut.balance, fast.reason
    assert "the smallest activation (after 0:Sequential, 32 B)" in fast.reason


@pytest.mark.parametrize(
    ("layers", "example", "kwargs", "message"),
    [
        ([nn.Linear(4, 4)], torch.randn(2, 4), {}, "at least 2 layers"),
        (_tower([4, 4, 4]), torch.randn(0, 4), {}, "at least one example"),
        (_tower([4, 4, 4]), torch.randn(2, 4), {"bandwidth_mbit": 0}, "bandwidth_mbit"),
    ],
)
def test_bad_input_is_named(
    layers: list[nn.Module], example: torch.Tensor, kwargs: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        advise_split(layers, example, **{"bandwidth_mbit": 60, "rtt_ms": 20, **kwargs})
