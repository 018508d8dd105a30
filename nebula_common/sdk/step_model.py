"""A job's step time on a link, as the trainers pipeline it: what ``auto`` compares codecs by.

Why a simulation and not ``compute + bytes / bandwidth``: the product overlaps the two
clusters' compute with each other and with the WAN (micro-batches in flight), so a link that
carries a step's bytes in less time than the stages compute costs almost nothing, and the sum
predicts savings a codec cannot deliver (a compute-bound job ran 0.97x of ``none`` with the
codec the sum chose). The model replays one optimizer step with the trainers' own op orders
(``services.trainer.runtime.schedule``): the upstream stage's forwards and backwards, the
downstream's forward-loss-backward per micro-batch, and each direction of the link as a FIFO
that carries one micro-batch's frame in ``bytes * 8 / bandwidth`` plus half the RTT of latency.
Codec time is added to the side that runs it (encode at the sender, decode at the receiver).

It is a model: it ignores the CPU the two clusters share on one host and the framing and
acknowledgement bytes. Its inputs are measured (``codec_advice.probe_micro_batch`` times the
job's own stages; the codec service's calibration times the codecs), never constants.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.trainer.runtime.schedule import downstream_ops, upstream_ops


@dataclass(frozen=True)
class StageTimes:
    """Seconds of compute per micro-batch on each side of the edge, without codecs."""

    upstream_forward: float
    upstream_backward: float
    downstream: float
    """The downstream side's forward, loss (or the rest of a chain) and backward of one micro-batch."""

    @property
    def sequential(self) -> float:
        """One micro-batch of both sides run one after the other (what an in-process trial step costs)."""
        return self.upstream_forward + self.upstream_backward + self.downstream


@dataclass(frozen=True)
class EdgeLoad:
    """What one micro-batch puts on the edge with one codec pair: frame bytes and codec seconds."""

    forward_bytes: int
    backward_bytes: int
    encode_forward: float = 0.0
    decode_forward: float = 0.0
    encode_backward: float = 0.0
    decode_backward: float = 0.0


@dataclass(frozen=True)
class Pipeline:
    """How the job pipelines a step: micro-batches, schedule and the activations it keeps in flight."""

    micro_batches: int
    schedule: str = "gpipe"
    max_in_flight: int = 4


def step_seconds(
    stages: StageTimes, load: EdgeLoad, bandwidth_bps: float, rtt_seconds: float, pipeline: Pipeline
) -> float:
    """Predicted seconds of one optimizer step: the upstream's last backward ends it."""
    if bandwidth_bps <= 0 or rtt_seconds < 0:
        raise ValueError("bandwidth must be > 0 bit/s and the RTT >= 0 s")
    latency = rtt_seconds / 2
    forward_wire = load.forward_bytes * 8 / bandwidth_bps
    backward_wire = load.backward_bytes * 8 / bandwidth_bps
    up_free = down_free = link_forward_free = link_backward_free = 0.0
    activation_at: dict[int, float] = {}
    gradient_at: dict[int, float] = {}
    pending = iter(downstream_ops(pipeline.micro_batches)[::2])  # the downstream's micro-batches, in order

    def downstream_until(micro_batch: int) -> None:
        nonlocal down_free, link_backward_free
        while micro_batch not in gradient_at:
            op = next(pending)
            start = max(down_free, activation_at[op.micro_batch])
            down_free = start + load.decode_forward + stages.downstream + load.encode_backward
            link_backward_free = max(link_backward_free, down_free) + backward_wire
            gradient_at[op.micro_batch] = link_backward_free + latency

    for op in upstream_ops(pipeline.schedule, pipeline.micro_batches, pipeline.max_in_flight):
        if op.kind == "F":
            up_free += stages.upstream_forward + load.encode_forward
            link_forward_free = max(link_forward_free, up_free) + forward_wire
            activation_at[op.micro_batch] = link_forward_free + latency
        else:
            downstream_until(op.micro_batch)
            up_free = (
                max(up_free, gradient_at[op.micro_batch]) + load.decode_backward + stages.upstream_backward
            )
    return up_free
