"""The demo's comparison of none and auto: tail losses, the speed-up with auto's own costs, the verdict."""

from __future__ import annotations

import pytest

from nebula_common.cli.demo import COMPARE_STEPS, comparison_jobs
from nebula_common.cli.demo_compare import LOSS_TOLERANCE, Comparison, tail_loss
from nebula_common.sdk.summary import JobSummary


def summary(losses: list[float], step_s: float, forward: int) -> JobSummary:
    done = JobSummary(job_id="j", steps=len(losses), losses=losses, step_seconds=[step_s] * len(losses))
    done.wan = {"forward": {"bytes": forward}, "backward": {"payload_bytes": forward // 2}}
    done.stage_states = {"encoder": "SUCCEEDED", "decoder": "SUCCEEDED"}
    return done


def test_the_tail_loss_is_the_mean_of_the_last_tenth_and_at_least_five_steps() -> None:
    assert tail_loss([9.0] * 95 + [1.0] * 5) == pytest.approx(5.0)  # 100 steps: the last 10
    assert tail_loss([9.0] * 90 + [1.0] * 10) == pytest.approx(1.0)
    assert tail_loss([9.0, 9.0, 1.0, 1.0, 1.0, 1.0, 1.0]) == pytest.approx(1.0)  # at least five
    assert tail_loss([2.0, 4.0]) == pytest.approx(3.0)  # all there are


def test_the_speed_up_counts_auto_s_advice_and_trial_time() -> None:
    none = summary([3.0] * 50 + [1.0] * 10, 0.6, 1_000_000)
    auto = summary([3.0] * 50 + [1.02] * 10, 0.2, 250_000)
    choice = {
        "forward": "int8",
        "backward": "int8",
        "predicted_step_seconds": 0.21,
        "baseline_step_seconds": 0.55,
    }
    compared = Comparison(none, 40.0, auto, 16.0, choice)
    assert compared.speedup == pytest.approx(2.5) and compared.step_speedup == pytest.approx(3.0)
    assert compared.loss_excess == pytest.approx(0.02) and compared.within_tolerance
    assert compared.verdict().startswith("auto: 2.50x faster than none")
    record = compared.to_json()
    assert record["complete"] and record["auto_codecs"] == ["int8", "int8"]
    assert record["loss_tolerance"] == LOSS_TOLERANCE
    worse = Comparison(none, 40.0, summary([3.0] * 50 + [1.2] * 10, 0.2, 250_000), 16.0, choice)
    assert not worse.within_tolerance and "beyond the 5% tolerance" in worse.verdict()


def test_the_demo_compares_none_with_auto_where_a_codec_may_touch_the_link() -> None:
    pair = comparison_jobs("numbers", {})
    assert pair is not None
    none, auto = pair
    assert none.spec.steps == auto.spec.steps == COMPARE_STEPS
    assert (none.spec.edge.codec.forward, none.spec.edge.codec.backward) == ("none", "none")
    assert (auto.spec.edge.codec.forward, auto.spec.edge.codec.backward) == ("auto", "auto")
    assert comparison_jobs("electra", {"steps": 20}) is None  # token ids one way, a sync tensor back


def test_a_failed_job_is_named_instead_of_compared() -> None:
    """A stage that never started leaves no losses: the demo says which job failed, never a traceback."""
    none = summary([3.0] * 20, 0.6, 1_000_000)
    failed = JobSummary(job_id="k", steps=20)
    failed.stage_states = {"encoder": "FAILED", "decoder": "FAILED"}
    compared = Comparison(none, 40.0, failed, 3.0, {"forward": "int8", "backward": "int8"})
    assert compared.missing == "no comparison: the auto job did not finish"
    assert compared.to_json() == {
        "complete": False,
        "reason": "no comparison: the auto job did not finish",
        "none_seconds": 40.0,
        "auto_seconds": 3.0,
    }
    both = Comparison(failed, 1.0, failed, 1.0, {})
    assert both.missing == "no comparison: the none and the auto job did not finish"
    assert Comparison(none, 40.0, none, 20.0, {"forward": "none", "backward": "none"}).missing == ""
