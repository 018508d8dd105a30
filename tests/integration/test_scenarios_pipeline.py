"""Cross-cluster pipelining on the real deployment: split == unsplit, any schedule; resume is exact.

The yardstick is the same job trained unsplit in this process
(``run_unsplit``): with codec ``none`` the split run must reproduce its per-step
losses (within 1e-5) and its final parameters, which the test reads back from
the trainers' checkpoints as plain torch state dicts, without Nebula.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from nebula_common.errors import NebulaError
from nebula_common.jobspec import LoadedJob, load_spec
from nebula_common.jobspec.reference import UnsplitResult, run_unsplit
from nebula_common.launcher import LocalDeployment
from nebula_common.sdk.client import ClusterSession, common_checkpoint_step, submit_job
from nebula_common.sdk.jobs import ProgramJob
from nebula_common.sdk.summary import JobSummary, summarize

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digit_sum" / "job.yaml"


def example(**overrides: Any) -> LoadedJob:
    base = {"edges.0.codec.forward": "none", "edges.0.codec.backward": "none", "steps": 6}
    return load_spec(EXAMPLE, {**base, **overrides})


def run(job: ProgramJob, sessions: dict[str, ClusterSession]) -> JobSummary:
    summary = summarize(job, submit_job(job, sessions))
    assert summary.succeeded, summary.stage_messages
    return summary


def run_replicated(job: ProgramJob, sessions: dict[str, ClusterSession]) -> JobSummary:
    """``run`` for a job with data-parallel replicas: a trainer confining stages with Landlock (no
    bubblewrap on this machine) must refuse it at submission, saying why."""
    try:
        return run(job, sessions)
    except NebulaError as exc:
        if "Landlock confinement denies" not in str(exc):
            raise
        assert "program.replicas 2" in str(exc) and "bubblewrap" in str(exc), exc
        pytest.skip(f"the trainers here confine stages with Landlock, which refuses replicas: {exc}")


def final_state(
    deployment: LocalDeployment, job: ProgramJob, step: int
) -> dict[str, dict[str, torch.Tensor]]:
    """Each stage's parameters from its own cluster's checkpoint: plain torch.load, no Nebula code."""
    states = {}
    for stage, cluster in job.clusters().items():
        # Checkpoints live in the submitting account's namespace: accounts/<owner>/jobs/...
        (path,) = (deployment.run_dir / cluster / "trainer" / "accounts").glob(
            f"*/jobs/{job.job_id}/{stage}/step-{step}/model.pt"
        )
        states[stage] = torch.load(path, weights_only=True)
    return states


def assert_matches(summary: JobSummary, states: dict, reference: UnsplitResult, first_step: int = 0) -> None:
    expected = reference.losses[first_step:]
    assert len(summary.losses) == len(expected)
    for step, (got, want) in enumerate(zip(summary.losses, expected, strict=True), start=first_step):
        assert abs(got - want) < 1e-5, f"step {step}: split loss {got} != unsplit {want}"
    for stage, state in states.items():
        assert state.keys() == reference.state_dicts[stage].keys()
        for name, tensor in state.items():
            torch.testing.assert_close(tensor, reference.state_dicts[stage][name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", [pytest.param("gpipe", marks=pytest.mark.long), "1f1b"])  # gpipe: CI
def test_pipelined_split_run_equals_the_sequential_unsplit_run(
    schedule: str, deployment: LocalDeployment, sessions: dict[str, ClusterSession]
) -> None:
    loaded = example(**{"pipeline.schedule": schedule, "data.micro_batches": 4, "pipeline.max_in_flight": 2})
    reference = run_unsplit(loaded)  # one process, micro-batches one after the other
    job = ProgramJob(loaded)
    summary = run(job, sessions)
    assert_matches(summary, final_state(deployment, job, 6), reference)
    assert reference.losses[-1] != reference.losses[0]  # it trained: equality is not of two no-ops


@pytest.mark.faults  # a job stopped and resumed (`make test-faults`)
def test_resume_continues_the_exact_step_sequence(
    deployment: LocalDeployment, sessions: dict[str, ClusterSession]
) -> None:
    reference = run_unsplit(example(**{"checkpoint.interval": 3}))
    first = ProgramJob(example(**{"checkpoint.interval": 3, "steps": 3}))
    run(first, sessions)
    stages = {stage: sessions[cluster] for stage, cluster in first.clusters().items()}
    step = common_checkpoint_step(first.job_id, stages)
    assert step == 3
    resumed = ProgramJob(example(**{"checkpoint.interval": 3}), resume_job_id=first.job_id, resume_step=step)
    summary = run(resumed, sessions)
    assert_matches(summary, final_state(deployment, resumed, 6), reference, first_step=3)


def test_hot_start_continues_an_unsplit_run_split_exactly(
    deployment: LocalDeployment, sessions: dict[str, ClusterSession]
) -> None:
    """Paper Fig. 8: steps 0-2 unsplit in this process, steps 3-5 across the clusters == 6 steps unsplit.

    Adam moments and the warmup position travel with the weights; without them step 3 would differ.
    """
    reference = run_unsplit(example())
    job, local = ProgramJob.hot_started(example(), 3)
    assert local.losses == reference.losses[:3]
    summary = run(job, sessions)
    assert_matches(summary, final_state(deployment, job, 6), reference, first_step=3)


def test_hot_start_with_swapped_stage_states_fails_naming_the_stage(
    sessions: dict[str, ClusterSession],
) -> None:
    good, _ = ProgramJob.hot_started(example(**{"steps": 2}), 1)
    states = good.initial_states
    swapped = ProgramJob(
        example(**{"steps": 2}),
        initial_states={"reader": states["head"], "head": states["reader"]},
        initial_step=1,
    )
    summary = summarize(swapped, submit_job(swapped, sessions))
    assert not summary.succeeded
    assert (
        "initial_state was made for stage 'head', not for stage 'reader'" in summary.stage_messages["reader"]
    )


def test_resume_needs_a_checkpoint_of_the_same_account(
    new_user: Any, sessions: dict[str, ClusterSession]
) -> None:
    first = ProgramJob(example(**{"steps": 2}))
    run(first, sessions)
    other = {"a": new_user("a", "carol"), "b": new_user("b", "dave")}
    stages = {stage: other[cluster] for stage, cluster in first.clusters().items()}
    assert common_checkpoint_step(first.job_id, stages) is None
    with pytest.raises(NebulaError, match="no checkpoint"):
        submit_job(ProgramJob(example(), resume_job_id=first.job_id, resume_step=2), other)


def nebula_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nebula_common.cli.app", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=200,
    )


def test_job_submit_runs_the_example_on_a_running_deployment(
    deployment: LocalDeployment, tmp_path: Path
) -> None:
    description = tmp_path / "deployment.json"
    deployment.write_description(description)
    out = tmp_path / "summary.json"
    submit = ["job", "submit", str(EXAMPLE), "--deployment", str(description), "--new-account"]
    result = nebula_cli(*submit, "--set", "steps=12", "--json", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(out.read_text())
    assert summary["succeeded"] and summary["steps"] == 12
    assert summary["checkpoint_steps"] == {"reader": 12, "head": 12}  # interval 10 and the final step
    assert summary["settings"]["codec_forward"] == "fp16"  # the spec's codecs reached the stages
    assert 0.0 <= summary["wait_fraction"]["reader"] <= 1.0


@pytest.mark.long  # an unsplit run, then a split one (`make test-faults`)
def test_job_submit_hot_start_trains_unsplit_then_split(deployment: LocalDeployment, tmp_path: Path) -> None:
    description = tmp_path / "deployment.json"
    deployment.write_description(description)
    out = tmp_path / "summary.json"
    submit = ["job", "submit", str(EXAMPLE), "--deployment", str(description), "--new-account"]
    submit += ["--set", "steps=4"]
    result = nebula_cli(*submit, "--hot-start-steps", "2", "--json", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "hot start: training steps 0..1 unsplit" in result.stdout
    summary = json.loads(out.read_text())
    assert summary["succeeded"] and summary["settings"]["hot_start_steps"] == 2
    assert summary["checkpoint_steps"] == {"reader": 4, "head": 4}
    assert len(summary["loss_per_step"]) == 2  # only steps 2 and 3 ran across the clusters


def test_job_submit_refuses_a_bad_spec_naming_the_field(deployment: LocalDeployment, tmp_path: Path) -> None:
    description = tmp_path / "deployment.json"
    deployment.write_description(description)
    submit = ["job", "submit", str(EXAMPLE), "--deployment", str(description)]
    # In this process (no second torch import): refused before anything reaches the deployment.
    from typer.testing import CliRunner

    from nebula_common.cli.app import app

    result = CliRunner().invoke(app, [*submit, "--set", "pipeline.schedule=zigzag"])
    assert result.exit_code == 2, (result.output, result.exception)
    assert "pipeline.schedule" in result.stderr  # errors go to stderr
    assert "pipeline.schedule" not in result.stdout and "Traceback" not in result.output


@pytest.mark.long  # two ranks and one, side by side (`make test-faults`)
def test_data_parallel_downstream_with_two_ranks_equals_one_rank_with_the_combined_batch(
    deployment: LocalDeployment, sessions: dict[str, ClusterSession]
) -> None:
    """backprop mode with the loss-owning stage on 2 processes: rank 0 scatters rows, gathers their gradients.

    SGD, because Adam turns float-reassociation noise in near-zero gradients into full-size steps.
    """
    optimizer = {"name": "sgd", "lr": 0.05, "momentum": 0.9}
    loaded = example(**{"stages.1.replicas": 2, "optimizer": optimizer, "pipeline.schedule": "1f1b"})
    reference = run_unsplit(loaded)  # one process, the combined batch
    job = ProgramJob(loaded)
    summary = run_replicated(job, sessions)
    assert_matches(summary, final_state(deployment, job, 6), reference)
    assert reference.losses[-1] != reference.losses[0]


@pytest.mark.long  # two ranks and one, side by side (`make test-faults`)
def test_data_parallel_upstream_with_two_ranks_equals_one_rank_with_the_combined_batch(
    deployment: LocalDeployment, sessions: dict[str, ClusterSession]
) -> None:
    """backprop mode, first stage on 2 processes: rank 0 gathers output rows, scatters their gradients.

    1F1B, so earlier micro-batches' backwards interleave with later forwards; SGD as in the downstream test.
    """
    optimizer = {"name": "sgd", "lr": 0.05, "momentum": 0.9}
    overrides = {"stages.0.replicas": 2, "optimizer": optimizer, "pipeline.schedule": "1f1b"}
    loaded = example(**overrides, **{"data.micro_batches": 4, "pipeline.max_in_flight": 2})
    reference = run_unsplit(loaded)  # one process, the combined batch
    job = ProgramJob(loaded)
    summary = run_replicated(job, sessions)
    assert_matches(summary, final_state(deployment, job, 6), reference)
    assert reference.losses[-1] != reference.losses[0]
