"""Resolve `codec: auto` once, at submission, so both clusters run the same concrete codecs.

Each cluster's codec service calibrates its own host, so asking two services
could yield two different answers, and a decoder refuses frames encoded with a
codec other than its own. The submitter therefore asks once: it measures one
real micro-batch of the job (the tensor that crosses the edge and the compute
time around it; it holds the whole job, so this costs one small local step),
asks the source cluster's codec service to rank codecs for the link, and
writes the winners into both stage specs together with the reasoning, which
each trainer records in its status and audit log.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from nebula_common.codec.advice import AdviceResult, job_advice_request
from nebula_common.codec.advice_client import advise_specs_sync
from nebula_common.codec.stream import canonical_spec
from nebula_common.jobspec.reference import build_programs
from nebula_common.jobspec.runtime import example_ids
from nebula_common.sdk.jobs import ProgramJob

AUTO = "auto"
DEFAULT_ERROR_BUDGET = 0.05


@dataclass(frozen=True)
class LinkProfile:
    """The WAN between the clusters as the submitter knows it (emulator settings, or measured)."""

    bandwidth_mbit: float
    rtt_ms: float

    def __post_init__(self) -> None:
        if not self.bandwidth_mbit > 0:
            raise ValueError(f"link bandwidth must be > 0 Mbit/s, got {self.bandwidth_mbit}")
        if self.rtt_ms < 0:
            raise ValueError(f"link RTT must be >= 0 ms, got {self.rtt_ms}")


@dataclass(frozen=True)
class MicroBatchProbe:
    activation_shape: tuple[int, ...]
    compute_seconds: float


def probe_micro_batch(job: ProgramJob) -> MicroBatchProbe:
    """Run one real micro-batch of the job locally: the edge tensor's shape and the compute around it."""
    spec = job.spec
    upstream, downstream = build_programs(job.loaded)
    size = spec.data.batch_size // spec.data.micro_batches
    ids = example_ids(spec.seed, spec.data.examples, 0, 0, spec.data.micro_batches, size)
    started = time.perf_counter()
    states = upstream.forward(upstream.batch(ids))
    received = states.detach().requires_grad_(True)
    downstream.loss(received, downstream.batch(ids)).backward()
    states.backward(received.grad)
    elapsed = time.perf_counter() - started
    return MicroBatchProbe(activation_shape=tuple(states.shape), compute_seconds=elapsed)


def needs_advice(job: ProgramJob) -> bool:
    codecs = job.spec.edge.codec
    return AUTO in (canonical_spec(codecs.forward), canonical_spec(codecs.backward))


def choice_record(
    advice: AdviceResult, forward: str, backward: str, probe: MicroBatchProbe, link: LinkProfile
) -> dict[str, Any]:
    return {
        "source": "codec-service advice",
        "forward": forward,
        "backward": backward,
        "predicted_step_seconds": advice.predicted_step_seconds,
        "baseline_step_seconds": advice.baseline_step_seconds,
        "link": {"bandwidth_mbit": link.bandwidth_mbit, "rtt_ms": link.rtt_ms},
        "activation_shape": list(probe.activation_shape),
        "compute_seconds_per_micro_batch": probe.compute_seconds,
        "calibration_host": advice.calibration_host,
        "alternatives": {
            d.direction: [
                {"spec": o.spec, "ratio": o.ratio, "rel_error": o.rel_error, "seconds": o.direction_seconds}
                for o in d.options[:5]
            ]
            for d in advice.directions
        },
    }


def resolve_auto_codecs(
    job: ProgramJob,
    codec_address: str,
    link: LinkProfile,
    *,
    error_budget: float = DEFAULT_ERROR_BUDGET,
    token: str | None = None,
) -> dict[str, Any] | None:
    """Replace `auto` in the job's codecs with the advised specs; the recorded choice, or None if no auto."""
    if not needs_advice(job):
        return None
    codecs = job.spec.edge.codec
    probe = probe_micro_batch(job)
    request = job_advice_request(
        bandwidth_bps=link.bandwidth_mbit * 1e6,
        rtt_seconds=link.rtt_ms / 1000.0,
        edge=job.edge,
        activation_shape=probe.activation_shape,
        micro_batches=job.spec.data.micro_batches,
        compute_seconds=probe.compute_seconds,
        error_budget=error_budget,
    )
    advice = advise_specs_sync(codec_address, request, token=token)
    forward = advice.forward_spec if canonical_spec(codecs.forward) == AUTO else codecs.forward
    backward = advice.backward_spec if canonical_spec(codecs.backward) == AUTO else codecs.backward
    record = choice_record(advice, forward, backward, probe, link)
    job.set_codecs(forward, backward, json.dumps(record, sort_keys=True))
    return record
