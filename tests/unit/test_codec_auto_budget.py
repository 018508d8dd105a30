"""The job's `auto` on the demo's own job, end to end in the submitter: what it trains and what it picks.

The real in-process advisor (``advise`` with this host's calibration), the real probe of the built-in
``numbers`` job and real trial runs; only the link is stated. A fast link cannot matter to this job:
``none``, nothing trained. A slow link and a long job: a trial within its budget, a compressing pair.
A short job on the same link: no trial, the reasons say why.
"""

from __future__ import annotations

from typing import Any

import pytest

from nebula_common.codec.advice import advise
from nebula_common.codec.calibration import Calibrator
from nebula_common.codec.trial import Candidate, TrialRun
from nebula_common.jobspec import load_spec
from nebula_common.jobspec.builtin import builtin_spec
from nebula_common.sdk import codec_advice
from nebula_common.sdk.auto_plan import MIN_GAIN, TRIAL_SHARE
from nebula_common.sdk.codec_advice import LinkProfile, advise_edge, probe_micro_batch
from nebula_common.sdk.jobs import ProgramJob
from tests.support.calibration import calibrated

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def calibrator(tmp_path_factory: pytest.TempPathFactory) -> Calibrator:
    return calibrated(
        tmp_path_factory.mktemp("calibration")
    )  # one thread: 0.9 s; two on a busy host: minutes


def numbers(steps: int) -> ProgramJob:
    overrides = {"steps": steps, "edges.0.codec.forward": "auto", "edges.0.codec.backward": "auto"}
    return ProgramJob(load_spec(builtin_spec("numbers"), overrides))


def decide(job: ProgramJob, link: LinkProfile, calibrator: Calibrator) -> tuple[str, str, dict, int]:
    """advise_edge on the job; also how many steps the trial runs trained in all."""
    trained = 0
    real = codec_advice.trial_run

    def counted(job_: ProgramJob, candidate: Candidate, steps: int, *args: Any, **kwargs: Any) -> TrialRun:
        nonlocal trained
        trained += steps
        return real(job_, candidate, steps, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:  # the real trial runs, counted
        patch.setattr(codec_advice, "trial_run", counted)
        forward, backward, record = advise_edge(
            job, 0, probe_micro_batch(job), lambda r: advise(r, calibrator), link, job.edge_codecs()
        )
    return forward, backward, record, trained


def test_a_link_that_cannot_matter_gets_none_and_no_trial(calibrator: Calibrator) -> None:
    job = numbers(steps=2000)
    forward, backward, record, trained = decide(job, LinkProfile(10_000.0, 0.2), calibrator)
    assert (forward, backward) == ("none", "none") and trained == 0, record["trial"]["reasons"]
    assert "the link cannot matter" in record["trial"]["reasons"][-1]


def test_a_slow_link_trials_within_five_percent_of_the_job_and_compresses(calibrator: Calibrator) -> None:
    job = numbers(steps=150)
    forward, backward, record, trained = decide(job, LinkProfile(10.0, 40.0), calibrator)
    assert "none" not in (forward, backward), record["trial"]["reasons"]
    trial = record["trial"]
    assert trial["trial_steps"] >= 4 and trial["baseline_trial_loss"] > 0
    # What the trial trained, priced at the probe's in-process step, is within the budget it stated.
    step = record["compute_seconds_per_micro_batch"] * job.spec.data.micro_batches
    predicted_job = trial["baseline_step_seconds"] * job.spec.steps
    assert trained * step <= TRIAL_SHARE * predicted_job * 1.0001, (trained, step, predicted_job)
    # Faster by the rule's margin (2.6x on an idle machine; 1.4x once, when load tripled the probe's compute).
    faster = trial["predicted_step_seconds"] <= (1 - MIN_GAIN) * trial["baseline_step_seconds"]
    assert faster, trial["reasons"]


def test_a_short_job_is_not_trialled_and_says_why(calibrator: Calibrator) -> None:
    job = numbers(steps=3)
    forward, backward, record, trained = decide(job, LinkProfile(10.0, 40.0), calibrator)
    assert trained == 0 and "none" not in (forward, backward)
    assert any(reason.startswith("no trial: its budget") for reason in record["trial"]["reasons"])
