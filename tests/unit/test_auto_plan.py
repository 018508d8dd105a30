"""How `auto` spends the job's time: nothing trained when the link cannot matter, trials within budget."""

from __future__ import annotations

import pytest

from nebula_common.codec.advice import BACKWARD, FORWARD, AdviceResult, DirectionAdvice, Option
from nebula_common.codec.trial import Candidate, Link
from nebula_common.sdk import auto_plan
from nebula_common.sdk.auto_plan import MIN_TRIAL_STEPS, TRIAL_SHARE, EdgeModel, plan, untried_decision
from nebula_common.sdk.step_model import Pipeline, StageTimes

SHAPE = (64, 4, 128)
RAW = 64 * 4 * 128 * 4  # float32 bytes of one micro-batch's activation


def option(spec: str, ratio: float, within: bool = True) -> Option:
    size = int(RAW * ratio)
    return Option(spec, ratio, size, 0.01, 0.0005, 0.0005, 0.0, 0.0, within)


def advice(*specs: tuple[str, float, bool]) -> AdviceResult:
    options = [option("none", 1.0)] + [option(spec, ratio, within) for spec, ratio, within in specs]
    directions = [DirectionAdvice("e", d, SHAPE, options, "synthetic", 0.05) for d in (FORWARD, BACKWARD)]
    return AdviceResult(directions, 0.0, 0.0)


def model(bandwidth_mbit: float, steps: int, compute: float = 0.03) -> EdgeModel:
    return EdgeModel(
        stages=StageTimes(compute / 3, compute / 3, compute),
        pipeline=Pipeline(micro_batches=2),
        link=Link(bandwidth_mbit * 1e6, 0.04),
        activation_shape=SHAPE,
        steps=steps,
        trial_step_seconds=2 * (compute / 3 * 2 + compute),
    )


ADVICE = advice(("int8", 0.25, True), ("int4", 0.125, False))
PAIRS = [Candidate("int8", "int8"), Candidate("int4", "int4"), Candidate("int8", "none")]
BOTH_WAYS = {(d, spec): spec == "int8" for d in (FORWARD, BACKWARD) for spec in ("int8", "int4")}


def test_a_fast_link_chooses_none_and_trains_nothing() -> None:
    sized = plan(model(10_000, steps=1000), ADVICE, PAIRS, wanted_steps=30)
    assert sized.faster == [] and sized.trial_steps == 0
    decision = untried_decision(sized, model(10_000, 1000).link, BOTH_WAYS)
    assert decision.chosen.name == "none" and "the link cannot matter" in decision.reasons[-1]


def test_a_slow_link_trials_within_its_budget() -> None:
    edge = model(10, steps=2000)
    sized = plan(edge, ADVICE, PAIRS, wanted_steps=30)
    assert [a.candidate.name for a in sized.faster][:2] == ["int4 / int4", "int8 / int8"]
    assert sized.trial_steps == 30 and sized.max_pairs == 3
    job_seconds = sized.baseline.predicted_step_seconds * edge.steps
    trial_cost = (1 + sized.max_pairs) * sized.trial_steps * edge.trial_step_seconds
    assert trial_cost <= sized.budget_seconds <= TRIAL_SHARE * job_seconds


def test_a_short_job_is_not_trialled_and_takes_the_fastest_pair_within_the_error_budget() -> None:
    edge = model(10, steps=20)
    sized = plan(edge, ADVICE, PAIRS, wanted_steps=30)
    assert sized.faster and sized.trial_steps == 0
    decision = untried_decision(sized, edge.link, BOTH_WAYS)
    assert decision.chosen == Candidate("int8", "int8")  # int4 is faster but over the error budget
    assert any(reason.startswith("no trial: its budget") for reason in decision.reasons)


def test_the_error_budget_is_judged_per_direction() -> None:
    """int4 within budget on the activations but not on the gradients: int4 / int4 is out, and the
    pair keeping int4 forward only is chosen over int8 / int8 when it is faster."""
    edge = model(10, steps=20)
    pairs = [Candidate("int4", "int4"), Candidate("int4", "int8"), Candidate("int8", "int8")]
    sized = plan(edge, ADVICE, pairs, wanted_steps=30)
    within = {(FORWARD, "int4"): True, (BACKWARD, "int4"): False} | {
        (d, "int8"): True for d in (FORWARD, BACKWARD)
    }
    decision = untried_decision(sized, edge.link, within)
    assert decision.chosen == Candidate("int4", "int8")
    flipped = {(FORWARD, "int4"): False, (BACKWARD, "int4"): True} | {
        (d, "int8"): True for d in (FORWARD, BACKWARD)
    }
    assert untried_decision(sized, edge.link, flipped).chosen == Candidate("int8", "int8")


def test_the_budget_is_at_most_half_the_predicted_saving() -> None:
    barely = advice(("fp16", 0.5, True))  # on a fast link: 4% faster
    edge = model(200, steps=10_000)
    sized = plan(edge, barely, [Candidate("fp16", "fp16")], wanted_steps=30)
    assert len(sized.faster) == 1
    saving = (sized.baseline.predicted_step_seconds - sized.faster[0].predicted_step_seconds) * edge.steps
    assert sized.budget_seconds == pytest.approx(saving / 2)
    assert sized.budget_seconds < TRIAL_SHARE * sized.baseline.predicted_step_seconds * edge.steps


def test_a_fixed_spec_the_service_did_not_rank_is_sized_by_the_codec() -> None:
    assert auto_plan.direction_load(ADVICE, FORWARD, "fp16", SHAPE)[0] == RAW // 2
    assert auto_plan.direction_load(ADVICE, BACKWARD, "none", SHAPE) == (RAW, 0.0005, 0.0005)
    assert MIN_TRIAL_STEPS >= 2
