"""Resolve `codec: auto` once, at submission, so both clusters run the same concrete codecs.

Each cluster's codec service calibrates its own host, so asking two services
could yield two different answers, and a decoder refuses frames encoded with a
codec other than its own. The submitter therefore asks once: it measures one
real micro-batch of the job (the tensor that crosses the edge and the compute
time around it; it holds the whole job, so this costs one small local step),
asks the source cluster's codec service to rank codecs for the link, and
writes the winners into both stage specs together with the reasoning, which
each trainer records in its status and audit log.

The codec service's ranking judges each direction by a relative-error budget on
one tensor; it cannot tell whether a codec hurts *training*. So, for a two-way
job, the submitter then runs a short trial (``nebula_common.codec.trial``): the
job's own stage programs train ``trial_steps`` steps from their seeded start with
``none`` and with the best-ranked codec pairs in the loop (real encode/decode at
the cut); the fastest pair predicted for the link whose trial loss stays within
``loss_tolerance`` of ``none``'s wins, and its reasoning goes into the record
(``trial``) and the job report.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import torch

from nebula_common.codec.advice import BACKWARD, FORWARD, AdviceResult, job_advice_request
from nebula_common.codec.advice_client import advise_specs_sync
from nebula_common.codec.stream import TensorStreamDecoder, TensorStreamEncoder, canonical_spec
from nebula_common.codec.trial import (
    DEFAULT_LOSS_TOLERANCE,
    DEFAULT_TRIAL_STEPS,
    Candidate,
    Link,
    TrialDecision,
    TrialRun,
    choose_by_trial,
)
from nebula_common.jobspec.reference import build_programs
from nebula_common.jobspec.runtime import example_ids
from nebula_common.sdk.jobs import ProgramJob

AUTO = "auto"
DEFAULT_ERROR_BUDGET = 0.05
TRIAL_OPTIONS_PER_DIRECTION = 3
"""The codec service's top options per direction that the trial pairs up (at most 3 x 3 pairs)."""
TRIAL_MAX_PAIRS = 3
"""Pairs trained ``trial_steps`` steps at most (fastest-predicted first); the rest are only calibrated."""


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


def trial_run(job: ProgramJob, candidate: Candidate, steps: int) -> TrialRun:
    """Train ``steps`` steps of the whole job here, the cut tensors through the candidate's real codecs.

    The same seeded parameters and data order for every candidate (``build_programs``/``example_ids``),
    so trial losses differ only by what the codecs did.
    """
    spec = job.spec
    upstream, downstream = build_programs(job.loaded)
    micro_batches = spec.data.micro_batches
    size = spec.data.batch_size // micro_batches
    fwd_enc, fwd_dec = TensorStreamEncoder(candidate.forward), TensorStreamDecoder(candidate.forward)
    bwd_enc, bwd_dec = TensorStreamEncoder(candidate.backward), TensorStreamDecoder(candidate.backward)
    losses, compute = [], []
    sizes = (0, 0)
    for step in range(steps):
        started, total, sent_bytes = time.perf_counter(), 0.0, [0, 0]
        for mb in range(micro_batches):
            ids = example_ids(spec.seed, spec.data.examples, step, mb, micro_batches, size)
            states = upstream.forward(upstream.batch(ids))
            encoded = fwd_enc.encode(states.detach(), step=step, sample_ids=ids)
            received = fwd_dec.decode(encoded.header, encoded.payload, sample_ids=ids).requires_grad_(True)
            loss = downstream.loss(received, downstream.batch(ids)) / micro_batches
            loss.backward()
            grad = received.grad if received.grad is not None else torch.zeros_like(received)
            encoded_grad = bwd_enc.encode(grad, step=step, sample_ids=ids)
            states.backward(bwd_dec.decode(encoded_grad.header, encoded_grad.payload, sample_ids=ids))
            total += loss.item()
            sent_bytes[0] += len(encoded.header.SerializeToString()) + len(encoded.payload)
            sent_bytes[1] += len(encoded_grad.header.SerializeToString()) + len(encoded_grad.payload)
        upstream.finish_step()
        downstream.finish_step()
        compute.append(time.perf_counter() - started)
        losses.append(total)
        sizes = (sent_bytes[0], sent_bytes[1])
    return TrialRun(losses, compute, *sizes)


def trial_candidates(advice: AdviceResult, forward: str, backward: str) -> list[Candidate]:
    """Pairs of the service's top options per direction; a direction the spec fixed stays fixed."""

    def top(direction: str, fixed: str) -> list[str]:
        if canonical_spec(fixed) != AUTO:
            return [fixed]
        options = next((d.options for d in advice.directions if d.direction == direction), [])
        return [o.spec for o in options[:TRIAL_OPTIONS_PER_DIRECTION]] or ["none"]

    pairs = [Candidate(f, b) for f in top(FORWARD, forward) for b in top(BACKWARD, backward)]
    return [pair for pair in pairs if (pair.forward, pair.backward) != ("none", "none")]


def choice_record(
    advice: AdviceResult,
    forward: str,
    backward: str,
    probe: MicroBatchProbe,
    link: LinkProfile,
    trial: TrialDecision | None = None,
) -> dict[str, Any]:
    record = {
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
    if trial is not None:
        record["trial"] = trial.record()
        record["predicted_step_seconds"] = trial.chosen_assessment.predicted_step_seconds
        record["baseline_step_seconds"] = trial.baseline.predicted_step_seconds
    return record


def resolve_auto_codecs(
    job: ProgramJob,
    codec_address: str,
    link: LinkProfile,
    *,
    error_budget: float = DEFAULT_ERROR_BUDGET,
    token: str | None = None,
    trial_steps: int = DEFAULT_TRIAL_STEPS,
    loss_tolerance: float = DEFAULT_LOSS_TOLERANCE,
) -> dict[str, Any] | None:
    """Replace `auto` in the job's codecs with the advised specs; the recorded choice, or None if no auto.

    With ``trial_steps`` >= 2 (and a two-way job) the service's top pairs are tried on the job itself
    and the fastest within ``loss_tolerance`` of ``none``'s trial loss is chosen (module docstring);
    a trial is never longer than the job (``trial_steps`` is capped at its steps).
    """
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
    trial = None
    candidates = trial_candidates(advice, codecs.forward, codecs.backward)
    trial_steps = min(trial_steps, job.spec.steps)  # never trial longer than the job itself
    if trial_steps >= 2 and job.spec.pipeline.mode != "one_way" and candidates:
        trial = choose_by_trial(
            candidates,
            lambda candidate, steps: trial_run(job, candidate, steps),
            Link(bandwidth_bps=link.bandwidth_mbit * 1e6, rtt_seconds=link.rtt_ms / 1000.0),
            tolerance=loss_tolerance,
            trial_steps=trial_steps,
            calibration_steps=2,
            max_trials=TRIAL_MAX_PAIRS,
        )
        forward, backward = trial.chosen.forward, trial.chosen.backward
    record = choice_record(advice, forward, backward, probe, link, trial)
    job.set_codecs(forward, backward, json.dumps(record, sort_keys=True))
    return record
