"""How ``auto`` spends its time: predict every pair with the pipelined step model, trial only what pays.

A trial trains the job here before it starts, so it is paid for in the job's own time. The rules:

* **The link cannot matter**: no pair is predicted at least ``MIN_GAIN`` (3%) faster than
  ``none``: ``none`` is chosen and nothing is trained (a compute-bound job, a fast link).
* **A trial costs at most** ``TRIAL_SHARE`` (5%) of the job's predicted time with ``none`` and at
  most half of what the fastest pair is predicted to save over the job, so a right prediction
  never leaves ``auto`` slower than ``none``. The steps it affords are split over the baseline and
  the pairs tried (at most ``TRIAL_MAX_PAIRS``, fastest-predicted first); fewer than
  ``MIN_TRIAL_STEPS`` each and the pair is chosen by the codec service's error budget alone,
  which the reasons say.

Predictions come from ``step_model`` on the job's measured stage times (``probe_micro_batch``)
and the codec service's frame sizes and codec seconds for this host.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from nebula_common.codec.advice import BACKWARD, FORWARD, AdviceResult, Option
from nebula_common.codec.base import dtype_from_name, numel
from nebula_common.codec.registry import get_codec
from nebula_common.codec.trial import Assessment, Candidate, Link, TrialDecision
from nebula_common.sdk.step_model import EdgeLoad, Pipeline, StageTimes, step_seconds

MIN_GAIN = 0.03
"""A pair must be predicted this much faster than ``none`` to be worth any quality risk or trial."""
TRIAL_SHARE = 0.05
"""At most this share of the job's predicted time (with ``none``) goes to trials."""
MIN_TRIAL_STEPS = 4
"""Fewer steps than this per trial run say nothing about training; the trial is skipped instead."""
TRIAL_MAX_PAIRS = 3
"""Pairs trained at most (fastest-predicted first)."""
NONE = Candidate("none", "none", "none")


@dataclass(frozen=True)
class EdgeModel:
    """Everything the prediction of one edge needs."""

    stages: StageTimes
    pipeline: Pipeline
    link: Link
    activation_shape: tuple[int, ...]
    steps: int
    trial_step_seconds: float
    """One in-process trial step: every stage's micro-batches one after the other."""
    trial_setup_seconds: float = 0.0
    """What each trial run pays before its first step (building the job's programs)."""


def direction_load(
    advice: AdviceResult, direction: str, spec: str, shape: Sequence[int]
) -> tuple[int, float, float]:
    """(bytes, encode s, decode s) of one micro-batch's tensor with ``spec``: the service's numbers if it
    ranked the spec, else the codec's own size bound and no codec time (a spec the user fixed)."""
    for each in advice.directions:
        if each.direction == direction:
            found: Option | None = next((o for o in each.options if o.spec == spec), None)
            if found is not None:
                return found.encoded_bytes, found.encode_seconds, found.decode_seconds
    float32 = dtype_from_name("float32")
    if spec == "none":
        return numel(shape) * 4, 0.0, 0.0
    return get_codec(spec).encoded_size(tuple(shape), float32), 0.0, 0.0


def predict(model: EdgeModel, advice: AdviceResult, candidate: Candidate) -> Assessment:
    """The candidate's predicted step on this edge (bytes per step, as a trial reports them)."""
    fwd = direction_load(advice, FORWARD, candidate.forward, model.activation_shape)
    bwd = direction_load(advice, BACKWARD, candidate.backward, model.activation_shape)
    load = EdgeLoad(fwd[0], bwd[0], fwd[1], fwd[2], bwd[1], bwd[2])
    seconds = step_seconds(
        model.stages, load, model.link.bandwidth_bps, model.link.rtt_seconds, model.pipeline
    )
    per_step = model.pipeline.micro_batches
    return Assessment(candidate, model.trial_step_seconds, fwd[0] * per_step, bwd[0] * per_step, seconds)


@dataclass
class TrialPlan:
    """What ``auto`` will do on one edge: the predictions, and how many steps a trial may train."""

    baseline: Assessment
    faster: list[Assessment]
    """Pairs predicted at least ``MIN_GAIN`` faster than ``none``, fastest first."""
    budget_seconds: float
    trial_steps: int
    """Steps per trial run (0: no trial)."""
    max_pairs: int


def plan(
    model: EdgeModel, advice: AdviceResult, candidates: Sequence[Candidate], wanted_steps: int
) -> TrialPlan:
    """Predict every candidate and size the trial by the rules of the module docstring."""
    base = predict(model, advice, NONE)
    ranked = sorted((predict(model, advice, c) for c in candidates), key=lambda a: a.predicted_step_seconds)
    faster = [a for a in ranked if a.predicted_step_seconds <= base.predicted_step_seconds * (1 - MIN_GAIN)]
    if not faster:
        return TrialPlan(base, [], 0.0, 0, 0)
    saving = (base.predicted_step_seconds - faster[0].predicted_step_seconds) * model.steps
    budget = min(TRIAL_SHARE * base.predicted_step_seconds * model.steps, saving / 2)
    pairs = min(TRIAL_MAX_PAIRS, len(faster))
    while True:
        per_run = budget / (1 + pairs) - model.trial_setup_seconds
        affordable = max(0, math.floor(per_run / max(model.trial_step_seconds, 1e-6)))
        steps = min(wanted_steps, model.steps, affordable)
        if steps >= MIN_TRIAL_STEPS or pairs == 1:
            break
        pairs -= 1
    return TrialPlan(base, faster, budget, steps if steps >= MIN_TRIAL_STEPS else 0, pairs)


def untried_decision(
    plan_: TrialPlan, link: Link, within_budget: dict[tuple[str, str], bool]
) -> TrialDecision:
    """The decision when nothing is trained: ``none`` if the link cannot matter, else the fastest pair
    whose directions the codec service found within its error budget, with the reasons.

    ``within_budget`` is keyed by (direction, spec): the same spec may be within budget on the
    activations and not on the gradients, whose error the service measures separately."""
    base = plan_.baseline
    decision = TrialDecision(NONE, link, 0.0, 0, base, list(plan_.faster))
    decision.reasons.append(
        f"link {link.bandwidth_bps / 1e6:g} Mbit/s, {link.rtt_seconds * 1000:g} ms RTT: "
        f"none predicted {base.predicted_step_seconds:.3f} s/step pipelined "
        f"({base.forward_bytes + base.backward_bytes:,} bytes a step)"
    )
    if not plan_.faster:
        decision.reasons.append(
            f"chose none: no pair is predicted {MIN_GAIN:.0%} faster (the link cannot matter), "
            "nothing trained"
        )
        return decision
    best = next(
        (
            a
            for a in plan_.faster
            if within_budget.get((FORWARD, a.candidate.forward), True)
            and within_budget.get((BACKWARD, a.candidate.backward), True)
        ),
        None,
    )
    decision.reasons.append(
        f"no trial: its budget ({plan_.budget_seconds:.2f} s, at most {TRIAL_SHARE:.0%} of the job's "
        f"predicted time and half the predicted saving) affords fewer than {MIN_TRIAL_STEPS} steps a run"
    )
    if best is None:
        decision.reasons.append("chose none: no faster pair is within the codec service's error budget")
        return decision
    decision.chosen = best.candidate
    speedup = base.predicted_step_seconds / best.predicted_step_seconds
    decision.reasons.append(
        f"chose {best.candidate.name}: predicted {best.predicted_step_seconds:.3f} s/step ({speedup:.1f}x), "
        "the fastest within the codec service's error budget (quality not trialled)"
    )
    return decision
