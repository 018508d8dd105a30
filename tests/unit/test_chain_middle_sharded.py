"""A chain's middle stage sharded (FSDP2 ``fsdp`` on 2 ranks, ``hsdp`` on 4) trains exactly like one rank.

The middle stage (``examples/chain``'s mixer) runs as a real ``ProgramRunner`` holding both of its
edges (rank 0 of the stage, the driver); its compute ranks are real spawned processes that shard
the mixer's parameters with ``fully_shard`` on a gloo mesh (hsdp: 2 replicate groups x 2 shards).
For every micro-batch the driver sends what came from above, each rank relays its rows and the
driver gathers the output rows (forward) and the gradient rows of what it received (backward).
Losses and every stage's final parameters must equal the 1-rank chain (which equals the unsplit
model, ``test_stage_chain``) within 1e-5 after 20 steps, under GPipe and 1F1B; each rank must hold
less of the mixer than the whole. The ranks' DCP checkpoints resume on another number of ranks
(1 plain process, 4 hsdp ranks) with the same next-step loss and final parameters.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from nebula_common.jobspec import load_spec
from nebula_common.jobspec.reference import UnsplitResult, run_unsplit
from nebula_common.sdk.jobs import ProgramJob
from tests.support.stage_log import STAGE_LOGGER, stage_running
from tests.support.torch_threads import one_torch_thread
from tests.unit.test_stage_chain import EXAMPLE, chain_job, check_equals_unsplit, run_chain

pytestmark = [pytest.mark.timeout(900), pytest.mark.long]  # rank processes: `make test-faults`
STEPS = 20
# Generous: 4 rank processes each import torch and set up FSDP2 first; on 2 cores at load 35+ that
# alone took over 240 s once.
FINISH_S = 600
RESUME_AT = 18  # a checkpoint of the sharded run (every 2 steps) that the resumed runs start from
# SGD, as the other data-parallel tests: Adam would turn float-reassociation noise in near-zero
# gradients (summed over ranks instead of computed at once) into full-size steps.
OPTIMIZER = {"name": "sgd", "lr": 0.05, "momentum": 0.9}
SCHEDULES = ("gpipe", "1f1b")
LAYOUTS = {"fsdp-2": ("fsdp", 2, None), "hsdp-4": ("hsdp", 4, 2), "plain-1": ("ddp", 1, None)}


def middle_job(layout: str, schedule: str, job_id: str | None = None, resume_from: str = "") -> ProgramJob:
    top = {"pipeline": {"schedule": schedule, "max_in_flight": 2}, "optimizer": OPTIMIZER}
    spec = chain_job(3, STEPS, **top).spec.model_dump(mode="json", by_alias=True)
    parallel, replicas, shard_size = LAYOUTS[layout]
    spec["stages"][1].update(parallel=parallel, replicas=replicas, shard_size=shard_size)
    loaded = load_spec(spec, base_dir=EXAMPLE.parent)
    if resume_from:
        return ProgramJob(loaded, job_id, resume_job_id=resume_from, resume_step=RESUME_AT)
    return ProgramJob(loaded, job_id)


def mixer_bytes(job: ProgramJob) -> int:
    state = run_unsplit(job.loaded, steps=0).state_dicts["mixer1"]  # parameters only (no buffers)
    return sum(value.numel() * value.element_size() for value in state.values())


def rank_bytes(records: list[logging.LogRecord]) -> list[int]:
    """What the middle stage's ranks said they hold, from its 'program stage running' record."""
    held = [
        fields["rank_parameter_bytes"]
        for fields in stage_running(records, "mixer1")
        if "rank_parameter_bytes" in fields
    ]
    assert len(held) == 1, held
    return list(held[0])


@pytest.fixture(scope="module")
def references() -> dict[str, UnsplitResult]:
    with one_torch_thread():  # tiny tensors: 0.17 s a schedule on one thread, 2.8 s on two beside other work
        refs = {schedule: run_unsplit(middle_job("plain-1", schedule).loaded) for schedule in SCHEDULES}
    assert refs["gpipe"].losses[-1] < refs["gpipe"].losses[0]  # it trained
    return refs


@pytest.fixture(scope="module")
def fsdp_gpipe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    work = tmp_path_factory.mktemp("fsdp")
    return work, run_chain(middle_job("fsdp-2", "gpipe", "sharded"), work, timeout=FINISH_S)


def test_an_fsdp_middle_stage_on_two_ranks_equals_one_rank_and_holds_half_of_it(
    fsdp_gpipe: tuple[Path, list[Any]], references: dict[str, UnsplitResult]
) -> None:
    work, runs = fsdp_gpipe
    check_equals_unsplit(runs, references["gpipe"], STEPS)
    stage = work / "mixer1" / "accounts" / "tester" / "jobs" / "sharded" / "mixer1"
    assert (stage / f"step-{STEPS}" / "dcp" / ".metadata").is_file()  # every rank wrote its shards (DCP)


@pytest.mark.parametrize(
    ("layout", "schedule"),
    [
        ("fsdp-2", "1f1b"),
        pytest.param("hsdp-4", "gpipe", marks=pytest.mark.long),  # four ranks: `make test-faults`
        pytest.param("hsdp-4", "1f1b", marks=pytest.mark.long),
    ],
)
def test_a_sharded_middle_stage_equals_one_rank_and_each_rank_holds_less(
    tmp_path: Path,
    references: dict[str, UnsplitResult],
    layout: str,
    schedule: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=STAGE_LOGGER)
    job = middle_job(layout, schedule)
    runs = run_chain(job, tmp_path, timeout=FINISH_S)
    check_equals_unsplit(runs, references[schedule], STEPS)
    _, replicas, _ = LAYOUTS[layout]
    held, whole = rank_bytes(caplog.records), mixer_bytes(job)
    assert len(held) == replicas and all(part < 0.6 * whole for part in held), (held, whole)
    # fsdp: the ranks hold the mixer once between them; hsdp: once per replicate group (2)
    assert sum(held) == pytest.approx(whole * (1 if layout == "fsdp-2" else 2), rel=0.05), (held, whole)


@pytest.mark.parametrize("layout", ["plain-1", pytest.param("hsdp-4", marks=pytest.mark.long)])
def test_a_sharded_middle_checkpoint_resumes_on_another_rank_count_with_the_same_next_loss(
    fsdp_gpipe: tuple[Path, list[Any]], references: dict[str, UnsplitResult], layout: str
) -> None:
    work, _ = fsdp_gpipe
    resumed = middle_job(layout, "gpipe", f"resumed-{layout}", resume_from="sharded")
    runs = run_chain(resumed, work, timeout=FINISH_S)
    check_equals_unsplit(runs, references["gpipe"], STEPS, start=RESUME_AT)
    assert sorted(runs[-1].losses()) == list(range(RESUME_AT, STEPS))
