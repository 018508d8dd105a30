"""Pipeline schedules of one optimizer step, as the op sequence each side of the cut executes.

Why explicit op lists: both clusters must agree on the order of every tensor on
the edge (the receiver checks (direction, step, micro_batch) of each frame), and
a schedule written as data can be tested for that and for its memory bound
without running anything.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

SCHEDULES = ("gpipe", "1f1b")


class Op(NamedTuple):
    kind: Literal["F", "B"]
    micro_batch: int


def upstream_ops(schedule: str, micro_batches: int, max_in_flight: int) -> list[Op]:
    """The sending stage's order of forwards (F) and backwards (B) within one step.

    gpipe: every forward first (activations of all micro-batches in flight),
    then every backward in order. 1f1b: at most ``max_in_flight`` activations
    whose gradient has not returned; after the warm-up forwards, each returning
    gradient is applied and immediately frees room for the next forward, so
    forward compute overlaps the WAN round trip of earlier micro-batches.
    """
    if micro_batches < 1 or max_in_flight < 1:
        raise ValueError("micro_batches and max_in_flight must be >= 1")
    if schedule == "gpipe":
        return [Op("F", i) for i in range(micro_batches)] + [Op("B", i) for i in range(micro_batches)]
    if schedule == "1f1b":
        warmup = min(micro_batches, max_in_flight)
        ops = [Op("F", i) for i in range(warmup)]
        for i in range(micro_batches):
            ops.append(Op("B", i))
            if i + warmup < micro_batches:
                ops.append(Op("F", i + warmup))
        return ops
    raise ValueError(f"unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")


def covering_window(
    gradient_latency_s: float, compute_per_micro_batch_s: float, cap: int, micro_batches: int
) -> int:
    """1F1B's window: the fewest activations in flight that keep the upstream from waiting.

    After handing micro-batch ``i``'s activation to the edge, a 1F1B upstream runs ``window - 1``
    forward+backward pairs before it needs ``i``'s gradient; the gradient takes
    ``gradient_latency_s`` (measured: the WAN round trip, both transfers, the codecs and the
    downstream's compute of one micro-batch). So ``(window - 1) * compute >= latency``. Bounded
    by ``cap`` (the job's ``max_in_flight``: the memory the user allows) and by the step's
    micro-batches, and at least 2 where those allow (one activation crossing while the next computes).
    """
    if cap < 1 or micro_batches < 1:
        raise ValueError("cap and micro_batches must be >= 1")
    if gradient_latency_s < 0 or compute_per_micro_batch_s < 0:
        raise ValueError("gradient latency and compute must be >= 0 seconds")
    top = min(cap, micro_batches)
    low = min(2, top)
    if compute_per_micro_batch_s <= 0:
        return top
    needed = 1 + math.ceil(gradient_latency_s / compute_per_micro_batch_s - 1e-9)
    return max(low, min(top, needed))


def downstream_ops(micro_batches: int) -> list[Op]:
    """The loss-owning stage: each micro-batch's activation in, its gradient straight back."""
    ops = []
    for i in range(micro_batches):
        ops += [Op("F", i), Op("B", i)]
    return ops


def peak_in_flight(ops: list[Op]) -> int:
    """Most activations held (sent, gradient not yet applied) at any point of an upstream schedule."""
    held = peak = 0
    for op in ops:
        held += 1 if op.kind == "F" else -1
        peak = max(peak, held)
    return peak
