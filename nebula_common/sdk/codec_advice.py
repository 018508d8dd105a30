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
``loss_tolerance`` of ``none``'s (and, when asked, whose gap is at most ``progress_tolerance``
of what ``none`` learned during the trial: the progress rule), wins; its reasoning,
naming the rule that rejected each faster pair, goes into the record (``trial``)
and the job report.

A chain decides each edge in turn (``resolve_chain_codecs``): that edge's own tensor and link,
its sending cluster's codec service, and a trial of the whole chain with the candidates on that
edge; the stages get one codec pair per edge and the per-edge choice.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nebula_common.codec.advice import BACKWARD, FORWARD, AdviceRequest, AdviceResult, job_advice_request
from nebula_common.codec.advice_client import advise_specs_sync
from nebula_common.codec.stream_endpoints import TensorStreamDecoder, TensorStreamEncoder
from nebula_common.codec.stream_options import canonical_spec
from nebula_common.codec.trial import (
    DEFAULT_LOSS_TOLERANCE,
    DEFAULT_TRIAL_STEPS,
    Assessment,
    Candidate,
    Link,
    TrialDecision,
    TrialRun,
    choose_by_trial,
)
from nebula_common.jobspec.reference import build_programs
from nebula_common.jobspec.runtime import example_ids
from nebula_common.sdk import auto_plan
from nebula_common.sdk.auto_plan import TRIAL_MAX_PAIRS, EdgeModel
from nebula_common.sdk.job_probe import MicroBatchProbe, one_torch_thread, probe_micro_batch
from nebula_common.sdk.jobs import ProgramJob
from nebula_common.sdk.links import AUTO, LinkProfile
from nebula_common.sdk.step_model import Pipeline

DEFAULT_ERROR_BUDGET = 0.0
"""The relative-error budget ``auto`` asks the codec service for: 0 takes the service's own per direction
(``codec.advice.DEFAULT_BUDGET``: tighter on activations, which the next stage reads as they are, than on
gradients, whose noise an optimizer averages out)."""
TRIAL_OPTIONS_PER_DIRECTION = 3
"""The codec service's top options per direction that the trial pairs up (at most 3 x 3 pairs)."""


Advisor = Callable[[AdviceRequest], AdviceResult]
"""Ranks codecs for one edge's request: a codec service (``advise_specs_sync``), or in-process ``advise``."""


def needs_advice(job: ProgramJob) -> bool:
    """Whether any edge's codec (of a two-stage job, or of any edge of a chain) is ``auto``."""
    return any(
        AUTO in (canonical_spec(c.codec.forward), canonical_spec(c.codec.backward)) for c in job.spec.edges
    )


def trial_run(
    job: ProgramJob,
    candidate: Candidate,
    steps: int,
    edge: int = 0,
    codecs: Sequence[tuple[str, str]] | None = None,
) -> TrialRun:
    """Train ``steps`` steps of the whole job here, every cut tensor through its edge's real codecs.

    The candidate's codecs sit on edge ``edge``; a chain's other edges use ``codecs`` (one
    (forward, backward) per edge; default ``none``). The bytes returned are edge ``edge``'s.
    The same seeded parameters and data order for every candidate (``build_programs``/``example_ids``),
    so trial losses differ only by what the codecs did.
    """
    spec = job.spec
    programs = build_programs(job.loaded)
    first, middles, last = programs[0], programs[1:-1], programs[-1]
    pairs = list(codecs) if codecs is not None else [("none", "none")] * len(spec.edges)
    pairs[edge] = (candidate.forward, candidate.backward)
    coders = [
        (TensorStreamEncoder(f), TensorStreamDecoder(f), TensorStreamEncoder(b), TensorStreamDecoder(b))
        for f, b in pairs
    ]
    micro_batches = spec.data.micro_batches
    size = spec.data.batch_size // micro_batches
    losses, compute = [], []
    sizes = (0, 0)
    for step in range(steps):
        started, total, sent_bytes = time.perf_counter(), 0.0, [0, 0]
        for mb in range(micro_batches):
            ids = example_ids(spec.seed, spec.data.examples, step, mb, micro_batches, size)
            cuts: list[tuple[torch.Tensor, torch.Tensor]] = []
            states = first.forward(first.batch(ids))
            for k in range(len(pairs)):  # edge k: encode, decode; a middle turns it into edge k+1's tensor
                fwd_enc, fwd_dec = coders[k][0], coders[k][1]
                encoded = fwd_enc.encode(states.detach(), step=step, sample_ids=ids)
                received = fwd_dec.decode(encoded.header, encoded.payload, sample_ids=ids).requires_grad_(
                    True
                )
                cuts.append((states, received))
                if k == edge:
                    sent_bytes[0] += len(encoded.header.SerializeToString()) + len(encoded.payload)
                if k < len(middles):
                    states = middles[k].relay(received, ids)
            loss = last.loss(cuts[-1][1], last.batch(ids)) / micro_batches
            loss.backward()
            for k in reversed(range(len(cuts))):  # gradients back up, each through its edge's codec
                sent, received = cuts[k]
                grad = received.grad if received.grad is not None else torch.zeros_like(received)
                bwd_enc, bwd_dec = coders[k][2], coders[k][3]
                encoded_grad = bwd_enc.encode(grad, step=step, sample_ids=ids)
                sent.backward(bwd_dec.decode(encoded_grad.header, encoded_grad.payload, sample_ids=ids))
                if k == edge:
                    sent_bytes[1] += len(encoded_grad.header.SerializeToString()) + len(encoded_grad.payload)
            total += loss.item()
        for program in programs:
            program.finish_step()
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
        "link": {"bandwidth_mbit": link.bandwidth_mbit, "rtt_ms": link.rtt_ms}
        | ({"source": link.source} if link.source else {}),
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


@dataclass(frozen=True)
class TrialSettings:
    """How ``auto`` is decided: the codec service's error budget, then the trial on the job itself."""

    error_budget: float = DEFAULT_ERROR_BUDGET
    trial_steps: int = DEFAULT_TRIAL_STEPS
    loss_tolerance: float = DEFAULT_LOSS_TOLERANCE
    progress_tolerance: float | None = None
    """The progress rule (``within_budget``): a candidate's trial-loss gap over ``none`` at most this
    share of what ``none`` learned during the trial; None (the default): the relative loss tolerance
    alone. Opt-in because a job's trial is short (at most ``trial_steps`` and the job's own steps): over
    a few steps ``none`` learns little, and a share of that little rejected every compressing codec of a
    6-step chain trial. The Table 5 benchmark uses it at ``DEFAULT_PROGRESS_TOLERANCE`` over 90 steps."""


def decide_by_trial(
    candidates: Sequence[Candidate],
    run: Callable[[Candidate, int], TrialRun],
    link: Link,
    settings: TrialSettings,
    trial_steps: int,
    estimate: Callable[[Candidate], Assessment] | None = None,
    max_trials: int = TRIAL_MAX_PAIRS,
) -> TrialDecision:
    """The ``auto`` decision: the fastest-predicted candidate within both of ``settings``' rules."""
    return choose_by_trial(
        candidates,
        run,
        link,
        tolerance=settings.loss_tolerance,
        progress_tolerance=settings.progress_tolerance,
        trial_steps=trial_steps,
        calibration_steps=2,
        max_trials=max_trials,
        estimate=estimate,
    )


def advise_edge(
    job: ProgramJob,
    index: int,
    probe: MicroBatchProbe,
    advisor: Advisor,
    link: LinkProfile,
    codecs: Sequence[tuple[str, str]],
    settings: TrialSettings = TrialSettings(),
) -> tuple[str, str, dict[str, Any]]:
    """Resolve ``auto`` on edge ``index``: (forward, backward, the recorded choice with its reasons).

    ``codecs``: every edge's (forward, backward) as known so far (a chain's other edges train with
    them in the trial; an ``auto`` one with ``none``). The request carries this edge's own tensor
    shape and link; every pair is predicted with the pipelined step model and the trial, sized by
    ``auto_plan``, trains the whole job with the candidates on this edge only.
    """
    declared = job.spec.edges[index]
    configured = (declared.codec.forward, declared.codec.backward)
    shapes = probe.edge_shapes or (probe.activation_shape,)
    edge_probe = dataclasses.replace(probe, activation_shape=shapes[index])
    spec = job.spec
    request = job_advice_request(
        bandwidth_bps=link.bandwidth_mbit * 1e6,
        rtt_seconds=link.rtt_ms / 1000.0,
        edge=declared.name,
        activation_shape=edge_probe.activation_shape,
        micro_batches=spec.data.micro_batches,
        compute_seconds=probe.compute_seconds,
        error_budget=settings.error_budget,
        samples=probe.samples[index] if probe.samples else None,
    )
    advice = advisor(request)
    forward = advice.forward_spec if canonical_spec(configured[0]) == AUTO else configured[0]
    backward = advice.backward_spec if canonical_spec(configured[1]) == AUTO else configured[1]
    if spec.pipeline.mode == "one_way":  # no gradient comes back: the service's ranking decides
        return forward, backward, choice_record(advice, forward, backward, edge_probe, link)
    others = [(_concrete(f), _concrete(b)) for f, b in codecs]
    wan = Link(bandwidth_bps=link.bandwidth_mbit * 1e6, rtt_seconds=link.rtt_ms / 1000.0)
    model = EdgeModel(
        stages=edge_probe.stage_times(index),
        pipeline=Pipeline(spec.data.micro_batches, spec.pipeline.schedule, spec.pipeline.max_in_flight),
        link=wan,
        activation_shape=edge_probe.activation_shape,
        steps=spec.steps,
        trial_step_seconds=probe.compute_seconds * spec.data.micro_batches,
        trial_setup_seconds=probe.setup_seconds,
    )
    sized = auto_plan.plan(model, advice, trial_candidates(advice, *configured), settings.trial_steps)
    if sized.trial_steps:
        clock = time.perf_counter()
        trial = decide_by_trial(
            [each.candidate for each in sized.faster],
            lambda candidate, steps: _on_one_thread(trial_run, job, candidate, steps, index, others),
            wan,
            settings,
            sized.trial_steps,
            estimate=lambda candidate: auto_plan.predict(model, advice, candidate),
            max_trials=sized.max_pairs,
        )
        spent = time.perf_counter() - clock
        trial.reasons.insert(
            1,
            f"trial budget {sized.budget_seconds:.2f} s: {sized.trial_steps} steps a run "
            f"(the trial took {spent:.2f} s)",
        )
    else:
        trial = auto_plan.untried_decision(sized, wan, _within_budget(advice))
    forward, backward = trial.chosen.forward, trial.chosen.backward
    return forward, backward, choice_record(advice, forward, backward, edge_probe, link, trial)


def _on_one_thread(run: Callable[..., TrialRun], *args: Any) -> TrialRun:
    """A trial run on one torch thread, as the probe that priced it (and the trainers) compute."""
    with one_torch_thread():
        return run(*args)


def _within_budget(advice: AdviceResult) -> dict[tuple[str, str], bool]:
    """Per (direction, ranked spec), whether the service found its error within budget there (on
    every edge of that direction)."""
    within: dict[tuple[str, str], bool] = {}
    for direction in advice.directions:
        for option in direction.options:
            key = (direction.direction, option.spec)
            within[key] = within.get(key, True) and option.within_budget
    return within


def _concrete(codec: str) -> str:
    """A codec a trial can run: ``auto`` not decided yet trains as ``none``."""
    return "none" if canonical_spec(codec) == AUTO else codec


def resolve_auto_codecs(
    job: ProgramJob,
    codec_address: str,
    link: LinkProfile,
    *,
    error_budget: float = DEFAULT_ERROR_BUDGET,
    token: str | None = None,
    trial_steps: int = DEFAULT_TRIAL_STEPS,
    loss_tolerance: float = DEFAULT_LOSS_TOLERANCE,
    progress_tolerance: float | None = None,
    probe: MicroBatchProbe | None = None,
) -> dict[str, Any] | None:
    """Replace `auto` in the job's codecs with the advised specs; the recorded choice, or None if no auto.

    With ``trial_steps`` >= 2 (and a two-way job) the service's top pairs are tried on the job itself
    and the fastest within ``loss_tolerance`` of ``none``'s trial loss, and whose gap is at most
    ``progress_tolerance`` of what ``none`` learned in the trial (None: no such rule), is chosen
    (module docstring);
    a trial is never longer than the job (``trial_steps`` is capped at its steps). A chain asks this
    one service for every edge, each with the same ``link`` (``resolve_chain_codecs`` takes one each).
    ``probe``: the job's micro-batch probe when already taken (else taken here).
    """
    if not needs_advice(job):
        return None
    settings = TrialSettings(error_budget, trial_steps, loss_tolerance, progress_tolerance)

    def advisor(request: AdviceRequest) -> AdviceResult:
        return advise_specs_sync(codec_address, request, token=token)

    if len(job.spec.edges) > 1:
        count = len(job.spec.edges)
        return resolve_chain_codecs(job, [advisor] * count, [link] * count, settings, probe=probe)
    forward, backward, record = advise_edge(
        job, 0, probe or probe_micro_batch(job), advisor, link, job.edge_codecs(), settings
    )
    job.set_codecs(forward, backward, json.dumps(record, sort_keys=True))
    return record


def resolve_chain_codecs(
    job: ProgramJob,
    advisors: Sequence[Advisor],
    links: Sequence[LinkProfile],
    settings: TrialSettings = TrialSettings(),
    probe: MicroBatchProbe | None = None,
) -> dict[str, Any]:
    """A chain's ``auto``: the advisor per edge, edge by edge in chain order; the per-edge choice.

    Edge K is advised by ``advisors[K]`` (its sending cluster's codec service) for ``links[K]``
    (the link between its two clusters) on its own activation shape; its trial trains the whole
    chain with the edges above it on their chosen codecs. A configured edge keeps its codecs and
    is recorded as such. The recorded choice (every stage gets it): ``{"source": "per-edge",
    "edges": [each edge's record, in chain order, named by its "edge"]}``.
    """
    count = len(job.spec.edges)
    if len(advisors) != count or len(links) != count:
        raise ValueError(f"a chain of {count} edges needs one advisor and one link per edge")
    probe = probe or probe_micro_batch(job)
    codecs = [(e.codec.forward, e.codec.backward) for e in job.spec.edges]
    records: list[dict[str, Any]] = []
    for index, declared in enumerate(job.spec.edges):
        forward, backward = codecs[index]
        if AUTO not in (canonical_spec(forward), canonical_spec(backward)):
            records.append(
                {"edge": declared.name, "source": "configured", "forward": forward, "backward": backward}
            )
            continue
        forward, backward, record = advise_edge(
            job, index, probe, advisors[index], links[index], codecs, settings
        )
        codecs[index] = (forward, backward)
        records.append({"edge": declared.name, **record})
    choice = {"source": "per-edge", "edges": records}
    job.set_edge_codecs(codecs, json.dumps(choice, sort_keys=True))
    return choice
