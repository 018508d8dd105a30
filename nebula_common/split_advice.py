"""Where to cut a model between two clusters, given the link (a split advisor, after RedCoast's rules).

A cut between layer ``i`` and ``i + 1`` sends layer ``i``'s output forward and its gradient back on
every step, and leaves layers ``0..i`` in one cluster and the rest in the other. The advisor runs the
model once on an example batch, layer by layer, and measures at every boundary what would cross
(bytes per example, each way: the activation and its gradient have the same size) and how the
compute (FLOPs of forward and backward, counted by ``torch.utils.flop_counter``, not timed, so the
advice does not depend on the load of the machine it runs on) would be divided. It then estimates a
step of the pipeline for each cut:

* WAN time: both directions' bytes at the link's bandwidth, plus one round trip;
* compute time: the larger of the two stages' FLOPs at ``flops_per_s`` (a pipeline runs at the pace
  of its slowest stage);

and suggests the cut with the smallest estimate, saying why (bytes crossing, the compute split, and
how much worse the runner-up is). Nothing is trained or sent anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode


@dataclass(frozen=True)
class Boundary:
    """One possible cut: after layer ``after`` (0-based), what crosses and how compute divides."""

    after: int
    name: str
    bytes_per_example: int  # forward activation; the gradient back is as large
    upstream_flops: int
    downstream_flops: int
    wan_s: float
    compute_s: float

    @property
    def step_s(self) -> float:
        return self.wan_s + self.compute_s

    @property
    def balance(self) -> float:
        """The smaller stage's share of the compute (0.5 = perfectly balanced)."""
        total = self.upstream_flops + self.downstream_flops
        return min(self.upstream_flops, self.downstream_flops) / total if total else 0.5


@dataclass(frozen=True)
class SplitAdvice:
    cut: Boundary
    candidates: list[Boundary] = field(default_factory=list)
    reason: str = ""


def _flops(module: nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Forward + backward FLOPs of one layer on ``x`` (a leaf that needs grad), and its output."""
    x = x.detach().requires_grad_(x.is_floating_point())
    with FlopCounterMode(display=False) as counter:
        out = module(x)
        if out.requires_grad:
            out.backward(torch.ones_like(out))
    return int(counter.get_total_flops()), out.detach()


def advise_split(
    layers: Sequence[nn.Module] | nn.Sequential,
    example: torch.Tensor,
    *,
    bandwidth_mbit: float,
    rtt_ms: float,
    flops_per_s: float = 5e10,
    names: Sequence[str] | None = None,
) -> SplitAdvice:
    """The best cut of ``layers`` (run in order on ``example``, a batch) for a link; every candidate too.

    ``flops_per_s``: what one cluster's stage computes per second (default 50 GFLOP/s, a CPU host;
    pass a GPU's figure). Raises ``ValueError`` naming what is wrong for fewer than two layers, an
    empty batch or a non-positive bandwidth.
    """
    layers = list(layers)
    if len(layers) < 2:
        raise ValueError(f"layers: a split needs at least 2 layers, got {len(layers)}")
    if example.dim() == 0 or example.shape[0] < 1:
        raise ValueError("example: a batch of at least one example (batch dimension first)")
    if bandwidth_mbit <= 0 or rtt_ms < 0 or flops_per_s <= 0:
        raise ValueError("bandwidth_mbit and flops_per_s must be > 0 and rtt_ms >= 0")
    names = list(names) if names is not None else [f"{i}:{type(m).__name__}" for i, m in enumerate(layers)]
    batch = example.shape[0]
    flops, sizes, x = [], [], example
    for layer in layers:
        count, x = _flops(layer, x)
        flops.append(count)
        sizes.append(x.numel() * x.element_size() // batch)
    bytes_per_s = bandwidth_mbit * 1e6 / 8
    candidates = []
    for i in range(len(layers) - 1):
        up, down = sum(flops[: i + 1]), sum(flops[i + 1 :])
        crossing = 2 * sizes[i] * batch  # activation forward, its gradient back
        candidates.append(
            Boundary(
                after=i,
                name=names[i],
                bytes_per_example=sizes[i],
                upstream_flops=up,
                downstream_flops=down,
                wan_s=crossing / bytes_per_s + rtt_ms / 1e3,
                compute_s=max(up, down) / flops_per_s,
            )
        )
    ranked = sorted(candidates, key=lambda b: (b.step_s, b.bytes_per_example, -b.balance))
    best = ranked[0]
    reason = (
        f"cut after {best.name}: {best.bytes_per_example} B per example cross each way "
        f"({best.wan_s * 1e3:.1f} ms of WAN per step at {bandwidth_mbit:g} Mbit/s, {rtt_ms:g} ms RTT), "
        f"and the compute splits {1 - best.balance:.0%}/{best.balance:.0%} "
        f"({best.compute_s * 1e3:.1f} ms for the slower stage)"
    )
    smallest = min(candidates, key=lambda b: b.bytes_per_example)
    if smallest is not best:
        reason += (
            f"; the smallest activation (after {smallest.name}, {smallest.bytes_per_example} B) "
            f"would leave a {1 - smallest.balance:.0%}/{smallest.balance:.0%} split, "
            f"{smallest.step_s / best.step_s:.2f}x the step time"
        )
    elif len(ranked) > 1:
        reason += (
            f"; the next best cut (after {ranked[1].name}) is {ranked[1].step_s / best.step_s:.2f}x slower"
        )
    return SplitAdvice(cut=best, candidates=candidates, reason=reason)
