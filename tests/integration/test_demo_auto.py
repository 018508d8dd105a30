"""`nebula demo` as `make demo` runs it: none, then auto, on the same slow link; auto must pay off.

The demo's default (no codec options): the built-in job with codec none and then with auto on one
deployment, its emulated WAN at 5 Mbit/s and 20 ms one way. Auto's time counts from submission
(probing the job, measuring the link, asking the codec service, its trial), so a broken advisor
(one that picks none, trials too long, or mispredicts the step) fails the speed-up; one that picks a
harmful codec fails the loss; one whose model is off fails the predictions.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nebula_common.cli.demo import COMPARE_STEPS

# About 100 s on an idle 2-core machine: `make test-faults` (CI), not `make test`.
pytestmark = [pytest.mark.integration, pytest.mark.long, pytest.mark.timeout(900)]


def test_the_demo_shows_auto_faster_than_none_at_the_same_loss(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    command = [sys.executable, "-m", "nebula_common.cli.app", "demo", "--json", str(out)]
    command += ["--run-dir", str(tmp_path / "run")]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=840)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(out.read_text())
    compared, baseline = summary["comparison"], summary["baseline"]
    assert summary["succeeded"] and baseline["succeeded"]
    assert summary["steps"] == baseline["steps"] == COMPARE_STEPS
    assert baseline["settings"]["codec_forward"] == baseline["settings"]["codec_backward"] == "none"
    assert "none" not in compared["auto_codecs"], compared
    # The bar is 2x from submission. Beside a CI run, whose load slows auto's probe and trial in
    # the submitter and both jobs' compute (not the link), it measured 2.48x (3.58x a step); the floors
    # leave room for that load. Auto picking none, a codec that does not pay or a trial that eats the
    # saving all stay under them.
    assert compared["speedup"] >= 1.8 and compared["step_speedup"] >= 2.4, compared
    assert compared["within_tolerance"] and compared["loss_excess"] <= 0.05, compared
    # The step model's predictions: on an idle machine within 25% of the steps measured (+1.5% for none,
    # +10% for auto; README). Here the load the probe saw is not the load the jobs see (the probe's
    # compute estimate ran 135-207 ms against about 120 ms in the jobs in one CI stage; beside a CI run
    # it was once twice what ran), so: none's step, which the link dominates, within 50%, and auto
    # predicted faster than none by at least a third of the gain it measured (a model that predicts
    # little or no gain still fails).
    none_step, auto_step = compared["none_predicted_step_seconds"], compared["auto_predicted_step_seconds"]
    assert abs(none_step - baseline["mean_step_seconds"]) <= 0.5 * baseline["mean_step_seconds"], compared
    assert none_step / auto_step >= 1 + (compared["step_speedup"] - 1) / 3, compared
    reasons = summary["settings"]["codec_choice"]["trial"]["reasons"]
    assert reasons[-1].startswith("chose") and "trial budget" in reasons[1], reasons
    assert "auto:" in result.stdout and "faster than none" in result.stdout
