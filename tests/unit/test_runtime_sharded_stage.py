"""Sharded stages in the pipeline loop: an fsdp or hsdp stage trains exactly like one process.

Both stages of the ``digit_sum`` example (its losses are means over examples, which is what makes
n ranks equal one process with the combined batch) run as real ``ProgramRunner``s on an in-memory edge;
the sharded stage's ranks are real processes (gloo) driven by the runner's thread. Its
checkpoints are DCP directories that a job resumes from on another number of ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nebula_common.jobspec import load_spec
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.jobs import ProgramJob
from services.trainer.edge import EdgeSettings
from services.trainer.edge.memory import MemoryLink
from tests.support.edges import StageRun, run_stages
from tests.support.torch_threads import one_torch_thread

pytestmark = [pytest.mark.timeout(180), pytest.mark.long]  # two-rank stages: `make test-faults`

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digit_sum" / "job.yaml"
SETTINGS = EdgeSettings(window_bytes=1 << 20, max_outage_s=20.0, retransmit_s=0.3, ready_timeout_s=60)
STEPS = 6
SUCCEEDED = trainer_pb2.STAGE_STATE_SUCCEEDED


SMALL = {
    "steps": STEPS,
    "data.batch_size": 32,
    "data.micro_batches": 2,
    "edges.0.codec": {"forward": "none", "backward": "none"},
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    "lr_schedule": {"name": "constant"},
    "checkpoint.interval": 3,
}
"""The small job's settings (SGD: Adam would turn reassociation noise in near-zero gradients into steps)."""


def small(job_id: str | None = None, resume_from: str = "", **overrides: object) -> ProgramJob:
    """A small numbers job (``SMALL``, with ``overrides``)."""
    fields = {**SMALL, **overrides}
    loaded = load_spec(EXAMPLE, fields)
    if resume_from:
        return ProgramJob(loaded, job_id, resume_job_id=resume_from, resume_step=3)
    return ProgramJob(loaded, job_id)


def same_training(run: tuple[StageRun, StageRun], ref: tuple[StageRun, StageRun], first: int = 0) -> None:
    for got, want in zip(run, ref, strict=True):
        assert got.final.state == SUCCEEDED, got.final.message
        for ours, theirs in zip(got.parameters(), want.parameters(), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    losses, ref_losses = run[1].losses(), ref[1].losses()
    assert sorted(losses) == list(range(first, STEPS))
    for step in range(first, STEPS):
        assert losses[step] == pytest.approx(ref_losses[step], abs=1e-5), step


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[StageRun, StageRun]:
    with one_torch_thread():  # tiny tensors: 6.0 s on one thread, 10.4 s on two beside other work
        runs = run_stages(small("ref"), tmp_path_factory.mktemp("ref"), MemoryLink(), SETTINGS)
    assert runs[1].losses()[STEPS - 1] < runs[1].losses()[0]
    return runs


@pytest.fixture(scope="module")
def fsdp_downstream(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple[StageRun, StageRun]]:
    work = tmp_path_factory.mktemp("fsdp")
    job = small("sharded", **{"stages.1.replicas": 2, "stages.1.parallel": "fsdp"})
    return work, run_stages(job, work, MemoryLink(), SETTINGS)


def test_an_fsdp_downstream_stage_on_two_ranks_trains_like_one_process(
    fsdp_downstream: tuple[Path, tuple[StageRun, StageRun]], reference: tuple[StageRun, StageRun]
) -> None:
    work, runs = fsdp_downstream
    same_training(runs, reference)
    stage = work / "head" / "accounts" / "tester" / "jobs" / "sharded" / "head"
    assert sorted(p.name for p in stage.iterdir() if p.name.startswith("step-")) == ["step-3", "step-6"]
    assert json.loads((stage / "step-6" / "meta.json").read_text())["format"] == "dcp"
    assert (stage / "step-6" / "dcp" / ".metadata").is_file()
    assert not list(stage.glob(".*partial*"))


@pytest.mark.long  # four ranks (`make test-faults`)
def test_an_hsdp_upstream_stage_on_four_ranks_trains_like_one_process(
    tmp_path: Path, reference: tuple[StageRun, StageRun]
) -> None:
    job = small(**{"stages.0.replicas": 4, "stages.0.parallel": "hsdp", "stages.0.shard_size": 2})
    same_training(run_stages(job, tmp_path, MemoryLink(), SETTINGS), reference)


@pytest.mark.parametrize(("replicas", "parallel"), [(1, "ddp"), (2, "ddp")])
def test_a_checkpoint_of_two_sharded_ranks_resumes_on_another_rank_count(
    fsdp_downstream: tuple[Path, tuple[StageRun, StageRun]],
    reference: tuple[StageRun, StageRun],
    replicas: int,
    parallel: str,
) -> None:
    work, _ = fsdp_downstream
    job = small(
        f"resumed-{replicas}", "sharded", **{"stages.1.replicas": replicas, "stages.1.parallel": parallel}
    )
    same_training(run_stages(job, work, MemoryLink(), SETTINGS), reference, first=3)


def test_a_ddp_checkpoint_cannot_be_resumed_sharded_and_the_stage_says_so(
    tmp_path: Path, reference: tuple[StageRun, StageRun]
) -> None:
    run_stages(small("plain"), tmp_path, MemoryLink(), SETTINGS)
    job = small("again", "plain", **{"stages.1.replicas": 2, "stages.1.parallel": "fsdp"})
    _, down = run_stages(job, tmp_path, MemoryLink(), SETTINGS)
    assert down.final.state == trainer_pb2.STAGE_STATE_FAILED
    assert "rank 0 failed: CheckpointError: checkpoint step-3" in down.final.message, down.final.message
    assert "written by an unsharded stage (model.pt); resume it with parallel: ddp" in down.final.message
