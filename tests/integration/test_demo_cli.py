"""`nebula demo` as a user runs it: a real deployment, a JSON summary, exit 0; bad options exit 2."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nebula_common.cli.app import app
from nebula_common.jobspec.builtin import builtin_spec
from nebula_common.sdk.api import Deployment

# The demo starts 11 processes one after another, trains and stops them: 96 s at load 20, 246 s at
# load 30 (of the old 280 s), the start alone over 180 s at load 32.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def nebula(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nebula_common.cli.app", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=540,
    )


@pytest.mark.long  # make test's slowest (25-40 s): with the demo's comparison in `make test-faults` (CI)
def test_demo_writes_a_summary_with_wan_bytes_and_verified_peers(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    result = nebula(
        "demo",
        "--steps",
        "6",
        "--codec-forward",
        "fp16",
        "--codec-backward",
        "int8",
        "--bandwidth-mbit",
        "100",
        "--delay-ms",
        "5",
        "--json",
        str(out),
        "--run-dir",
        str(tmp_path / "run"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(out.read_text())
    assert summary["settings"]["job"] == "numbers"  # the default demo job
    assert summary["succeeded"] and summary["steps"] == 6 and len(summary["loss_per_step"]) == 6
    assert summary["final_loss"] < summary["initial_loss"]
    forward, backward = summary["wan"]["forward"], summary["wan"]["backward"]
    assert forward["bytes"] == forward["prometheus_bytes"] == forward["bytes_received_by_peer"]
    assert backward["bytes"] == backward["prometheus_bytes"] == backward["bytes_received_by_peer"]
    assert forward["compression_ratio"] == pytest.approx(2.0)
    assert backward["compression_ratio"] == pytest.approx(4.0, rel=1e-3)
    assert summary["peer_identities"] == {
        "a": "spiffe://nebula/cluster/b/switch",
        "b": "spiffe://nebula/cluster/a/switch",
    }
    # The demo is an ordinary spec job: each stage checkpointed its final step on its own cluster.
    assert summary["checkpoint_steps"] == {"encoder": 6, "decoder": 6}
    for cluster, stage in (("a", "encoder"), ("b", "decoder")):
        account = f"researcher-{cluster}"  # each cluster's own account owns its stage's checkpoints
        trainer_dir = tmp_path / "run" / cluster / "trainer"
        assert (trainer_dir / "accounts" / account / "jobs" / summary["job_id"] / stage / "step-6").is_dir()
    # Every process was stopped: no stray services left behind by the demo.
    assert "summary written to" in result.stdout
    # It trained over internal TLS: each service had its own identity, nothing fell back to
    # plaintext (that needs the development flag, and logs a warning naming it).
    for cluster in ("a", "b"):
        for service in ("auth", "codec", "data", "switch", "trainer"):
            assert (tmp_path / "run" / "pki" / cluster / "services" / service / "service.crt").is_file()
    assert "PLAINTEXT" not in result.stdout + result.stderr
    assert f"nebula job list --deployment {tmp_path / 'run'}" in " ".join(result.stdout.split())
    check_the_stopped_demo_is_still_listed(tmp_path / "run", summary, tmp_path)


def check_the_stopped_demo_is_still_listed(run: Path, summary: dict, tmp_path: Path) -> None:
    """After the demo stopped its deployment, the job is found again from the trainers' records."""
    runner = CliRunner()
    note = "(deployment stopped; read from records in"
    listed = runner.invoke(app, ["job", "list", "--deployment", str(run), "--json"])
    assert listed.exit_code == 0, listed.output
    assert note in " ".join(listed.stderr.split()) and str(run / "a" / "trainer") in listed.stderr
    jobs = json.loads(listed.stdout)
    assert [j["job_id"] for j in jobs] == [summary["job_id"]]
    job = jobs[0]
    assert job["state"] == "SUCCEEDED" and job["steps_done"] == job["steps"] == 6
    # The finished job keeps its last step's loss and step time (the trainers' final status and records).
    assert isinstance(job["loss"], float) and math.isfinite(job["loss"]), job
    assert job["loss"] == summary["final_loss"] == summary["loss_per_step"][-1], (job["loss"], summary)
    (decoder,) = [s for s in job["stages"] if s["stage"] == "decoder"]
    assert decoder["step_seconds"] == summary["step_seconds_per_step"][-1], (decoder, summary)
    assert job["owners"] == {"a": "researcher-a", "b": "researcher-b"}
    assert job["clusters"] == {"encoder": "a", "decoder": "b"}
    assert job["traffic"]["forward"]["compression_ratio"] == pytest.approx(2.0)
    assert job["traffic"]["backward"]["compression_ratio"] == pytest.approx(4.0, rel=0.02)

    # The run directory's endpoints file (the one file for any deployment) knows it too.
    again = runner.invoke(app, ["job", "list", "--deployment", str(run / "endpoints.json"), "--json"])
    assert again.exit_code == 0 and json.loads(again.stdout) == jobs, again.output
    assert note in " ".join(again.stderr.split())

    status = runner.invoke(app, ["job", "status", summary["job_id"], "--deployment", str(run), "--json"])
    assert status.exit_code == 0 and json.loads(status.stdout)["state"] == "SUCCEEDED", status.output
    assert json.loads(status.stdout)["loss"] == summary["final_loss"], status.output
    shown = runner.invoke(app, ["job", "status", summary["job_id"], "--deployment", str(run)])
    assert shown.exit_code == 0 and f"{summary['final_loss']:.4f}" in shown.stdout, shown.output
    page = tmp_path / "demo-report.html"
    report = runner.invoke(
        app, ["job", "report", summary["job_id"], "--deployment", str(run), "--out", str(page), "--json"]
    )
    assert report.exit_code == 0, report.output
    assert f"Job {summary['job_id']}" in page.read_text() and "SUCCEEDED" in page.read_text()
    # Every step is in it, from the trainers' history files: the same losses and step times the
    # demo watched live, to the last bit.
    with Deployment.open(run) as deployment:
        recorded = deployment.job(summary["job_id"]).wait()
    assert recorded.losses == summary["loss_per_step"], (recorded.losses, summary["loss_per_step"])
    assert recorded.step_seconds == summary["step_seconds_per_step"]
    assert len(recorded.wan_bytes_per_step) == 6 and recorded.wan_bytes_per_step[-1] > 0
    first, last = summary["loss_per_step"][0], summary["loss_per_step"][-1]
    assert f"{first:.4f} -&gt; {last:.4f}" in page.read_text(), "the report's loss does not span the steps"
    # Nothing runs any more: a cancel says so instead of pretending, and names no traceback.
    cancel = runner.invoke(app, ["job", "cancel", summary["job_id"], "--deployment", str(run)])
    assert cancel.exit_code == 1 and "deployment is stopped" in " ".join(cancel.output.split())
    assert "Traceback" not in cancel.output
    spec = str(builtin_spec("numbers"))
    submitted = runner.invoke(app, ["job", "submit", spec, "--deployment", str(run)])
    assert submitted.exit_code == 1 and "is stopped: start it again" in " ".join(submitted.output.split())
    unknown = runner.invoke(app, ["job", "status", "no-such-job", "--deployment", str(run)])
    assert unknown.exit_code == 1 and "no job 'no-such-job'" in " ".join(unknown.output.split())


def refused(*args: str) -> str:
    """Run ``nebula demo ARGS`` in this process (no second torch import); it must exit 2 with no
    traceback. Its output."""
    from typer.testing import CliRunner

    from nebula_common.cli.app import app

    result = CliRunner().invoke(app, ["demo", *args])
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    return result.output


def test_demo_rejects_an_unknown_codec_before_starting_anything(tmp_path: Path) -> None:
    assert "zip9" in refused("--codec-forward", "zip9", "--run-dir", str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_demo_rejects_an_unknown_job_before_starting_anything(tmp_path: Path) -> None:
    assert "gan" in refused("--job", "gan", "--run-dir", str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
