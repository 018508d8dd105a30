"""The trial advisor on a real two-stage torch model with the real stream codecs at the cut."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from nebula_common.codec import TensorStreamDecoder, TensorStreamEncoder
from nebula_common.codec.base import CodecError
from nebula_common.codec.trial import Candidate, Link, TrialRun, choose_by_trial, trial_loss, within_budget
from tests.support.torch_threads import one_torch_thread

pytestmark = pytest.mark.timeout(300)  # CPU seconds each; the first optimizer imports torch._dynamo
SLOW_LINK = Link(bandwidth_bps=1e6, rtt_seconds=0.02)  # 1 Mbit/s: the wire dominates a tiny model's step


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny tensors: more torch threads only contend on a busy host."""
    with one_torch_thread():
        yield


def two_stage_run(candidate: Candidate, steps: int) -> TrialRun:
    """A regression split in two (64 -> 32 | 32 -> 1), the cut tensors through the candidate's codecs."""
    torch.manual_seed(0)
    upstream = nn.Sequential(nn.Linear(64, 32), nn.Tanh())
    downstream = nn.Linear(32, 1)
    target_weights = torch.randn(64, 1, generator=torch.Generator().manual_seed(1))
    up_opt = torch.optim.SGD(upstream.parameters(), lr=0.05)
    down_opt = torch.optim.SGD(downstream.parameters(), lr=0.05)
    fwd = TensorStreamEncoder(candidate.forward), TensorStreamDecoder(candidate.forward)
    bwd = TensorStreamEncoder(candidate.backward), TensorStreamDecoder(candidate.backward)
    data = torch.Generator().manual_seed(2)
    losses, compute = [], []
    sizes = (0, 0)
    for step in range(steps):
        x = torch.randn(64, 64, generator=data)
        started = time.process_time()
        sent = upstream(x)
        encoded = fwd[0].encode(sent.detach(), step=step)
        received = fwd[1].decode(encoded.header, encoded.payload).requires_grad_(True)
        loss = nn.functional.mse_loss(downstream(received), x @ target_weights)
        down_opt.zero_grad()
        loss.backward()
        down_opt.step()
        encoded_grad = bwd[0].encode(received.grad, step=step)
        up_opt.zero_grad()
        sent.backward(bwd[1].decode(encoded_grad.header, encoded_grad.payload))
        up_opt.step()
        compute.append(time.process_time() - started)
        losses.append(loss.item())
        sizes = (len(encoded.payload), len(encoded_grad.payload))
    return TrialRun(losses, compute, *sizes)


def test_the_fastest_candidate_that_hurts_the_loss_is_rejected_for_the_next_fastest_that_does_not() -> None:
    harmful = Candidate("fp16(topk(0.02))", "fp16(topk(0.02))", "topk 2% both ways")  # no error feedback
    good = Candidate("fp16", "int8", "fp16/int8")
    decision = choose_by_trial([good, harmful], two_stage_run, SLOW_LINK, trial_steps=25, tolerance=0.02)

    by_name = {a.candidate.name: a for a in decision.assessments}
    # topk(0.02) sends ~1/25 of the values: predicted fastest, so it is tried first...
    assert by_name["topk 2% both ways"].predicted_step_seconds < by_name["fp16/int8"].predicted_step_seconds
    assert by_name["fp16/int8"].predicted_step_seconds < decision.baseline.predicted_step_seconds
    # ...and its loss is far over the tolerance, while fp16/int8 stays within it and wins.
    assert by_name["topk 2% both ways"].within is False and by_name["topk 2% both ways"].excess > 0.02
    assert by_name["fp16/int8"].within is True
    assert decision.chosen == good
    record = decision.record()
    assert (record["forward"], record["backward"]) == ("fp16", "int8")
    assert record["predicted_step_seconds"] < record["baseline_step_seconds"]
    assert any("topk 2% both ways" in r and "over the 2% tolerance" in r for r in record["reasons"])
    assert record["reasons"][-1].startswith("chose fp16/int8")


def test_no_candidate_within_tolerance_keeps_the_baseline_and_says_so() -> None:
    harmful = Candidate("fp16(topk(0.02))", "fp16(topk(0.02))")
    decision = choose_by_trial([harmful], two_stage_run, SLOW_LINK, trial_steps=25, tolerance=0.0)
    assert decision.chosen.forward == "none" and decision.chosen.backward == "none"
    assert "no faster candidate stayed within the tolerance" in decision.reasons[-1]


def test_max_trials_bounds_the_calibration() -> None:
    calls: list[tuple[str, int]] = []

    def counted(candidate: Candidate, steps: int) -> TrialRun:
        calls.append((candidate.name, steps))
        return two_stage_run(candidate, steps)

    harmful = [Candidate(f"fp16(topk({r}))", f"fp16(topk({r}))") for r in (0.01, 0.02)]
    decision = choose_by_trial(harmful, counted, SLOW_LINK, trial_steps=10, tolerance=0.0, max_trials=1)
    long_runs = [name for name, steps in calls if steps == 10]
    assert len(long_runs) == 2  # the baseline and one candidate, not both
    assert any("stopped after 1 trials" in r for r in decision.reasons)


def test_bad_input_is_refused_with_a_clear_message() -> None:
    with pytest.raises(CodecError, match="bandwidth"):
        Link(bandwidth_bps=0, rtt_seconds=0.01)
    with pytest.raises(CodecError, match="RTT"):
        Link(bandwidth_bps=1e6, rtt_seconds=-1)
    with pytest.raises(CodecError, match="at least one candidate"):
        choose_by_trial([], two_stage_run, SLOW_LINK)
    with pytest.raises(CodecError, match="tolerance"):
        choose_by_trial([Candidate("fp16", "fp16")], two_stage_run, SLOW_LINK, tolerance=-0.1)
    with pytest.raises(CodecError, match="not finite"):
        trial_loss([1.0, float("nan")])


def test_a_jobs_own_programs_run_the_trial_with_the_codecs_in_the_loop() -> None:
    from nebula_common.codec.advice import BACKWARD, FORWARD, AdviceResult, DirectionAdvice, Option
    from nebula_common.jobspec import load_spec
    from nebula_common.jobspec.builtin import builtin_spec
    from nebula_common.sdk.codec_advice import trial_candidates, trial_run
    from nebula_common.sdk.jobs import ProgramJob

    job = ProgramJob(load_spec(builtin_spec("numbers"), {"steps": 4}))
    none = trial_run(job, Candidate("none", "none"), 4)
    again = trial_run(job, Candidate("none", "none"), 4)
    assert none.losses == again.losses  # seeded start and data: a trial is repeatable
    int8 = trial_run(job, Candidate("int8", "int8"), 4)
    assert int8.forward_bytes * 3 < none.forward_bytes and int8.backward_bytes * 3 < none.backward_bytes
    assert int8.losses != none.losses and len(int8.compute_seconds) == 4

    def options(*specs: str) -> list[Option]:
        return [Option(s, 1.0, 1, 0.0, 0.0, 0.0, 0.0, 0.0, True) for s in specs]

    advice = AdviceResult(
        [
            DirectionAdvice("e", FORWARD, (1,), options("fp16", "none", "int8", "int4"), "sample", 0.05),
            DirectionAdvice("e", BACKWARD, (1,), options("int8", "none"), "sample", 0.25),
        ],
        0.0,
        0.0,
    )
    pairs = {(c.forward, c.backward) for c in trial_candidates(advice, "auto", "auto")}
    assert pairs == {("fp16", "int8"), ("fp16", "none"), ("none", "int8"), ("int8", "int8"), ("int8", "none")}
    fixed = {(c.forward, c.backward) for c in trial_candidates(advice, "auto", "bf16")}
    assert fixed == {("fp16", "bf16"), ("none", "bf16"), ("int8", "bf16")}


def test_a_gap_that_opens_late_is_caught_by_the_progress_rule_not_by_the_relative_loss_alone() -> None:
    # Trial curves shaped like Table 5's at 90 steps (full plan): the loss is flat through the lr
    # warm-up, then none's falls; a bottleneck row falls 20% slower, so after 90 steps it is only ~2%
    # over none (within a 2% loss tolerance) but 20% of none's progress short; int8 both ways falls 1%
    # slower. Recorded-style numbers, no timing: compute seconds and bytes are given.
    def curve(rate: float) -> list[float]:
        return [5.05 if step < 45 else 5.05 - rate * 0.8 * (step - 44) / 45 for step in range(90)]

    runs = {
        "none": TrialRun(curve(1.0), [0.28] * 90, 786_472, 786_472),
        "bottleneck": TrialRun(curve(0.8), [0.27] * 90, 12_000, 12_000),
        "int8 both": TrialRun(curve(0.99), [0.29] * 90, 45_000, 40_000),
    }
    candidates = [Candidate("int8", "int8", "int8 both"), Candidate("cut", "cut", "bottleneck")]

    def replay(candidate: Candidate, steps: int) -> TrialRun:
        recorded = runs[candidate.name]
        return TrialRun(recorded.losses[:steps], recorded.compute_seconds[:steps], *_bytes(recorded))

    link = Link(bandwidth_bps=2e6, rtt_seconds=0.02)
    lenient = choose_by_trial(candidates, replay, link, trial_steps=90, tolerance=0.02)
    assert lenient.chosen.name == "bottleneck"  # the relative loss alone: +1.4%, within 2%
    strict = choose_by_trial(
        candidates, replay, link, trial_steps=90, tolerance=0.02, progress_tolerance=0.10
    )
    by_name = {a.candidate.name: a for a in strict.assessments}
    assert by_name["bottleneck"].within is False and 0.15 < by_name["bottleneck"].progress_share < 0.25
    assert by_name["int8 both"].within is True and by_name["int8 both"].progress_share < 0.02
    assert strict.chosen.name == "int8 both"
    record = strict.record()
    assert record["progress_tolerance"] == 0.10 and record["baseline_progress"] > 0.3
    assert any(
        "bottleneck" in r and "within the 2% tolerance but over the progress rule" in r
        for r in record["reasons"]
    )
    # The rule itself: a baseline that learned nothing (progress <= 0) leaves only the relative excess.
    assert within_budget(5.0, 5.0, tolerance=0.02, progress=0.0, progress_tolerance=0.1) == (True, 0.0, None)
    within, excess, share = within_budget(4.75, 4.70, tolerance=0.02, progress=0.30, progress_tolerance=0.1)
    assert not within and excess == pytest.approx(0.05 / 4.70) and share == pytest.approx(0.05 / 0.30)
    with pytest.raises(CodecError, match="progress tolerance"):
        choose_by_trial(candidates, replay, link, progress_tolerance=-1)


def _bytes(run: TrialRun) -> tuple[int, int]:
    return run.forward_bytes, run.backward_bytes
