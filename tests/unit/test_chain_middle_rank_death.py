"""A rank of a chain's middle stage dies: the stage fails naming it, and the job resumes and ends as if not.

The middle stage (``examples/chain``'s mixer, ``parallel: fsdp``) runs on two worker processes
started on their own (``python -m services.trainer.worker``, torchrun-style variables), driven by
its ``ProgramRunner``, which alone holds both of its edges; the reader and the head run on one
process each. Rank 1's process is killed (SIGKILL) mid-run: the middle stage must fail with a
reason naming rank 1, its neighbours must end too (the failure travels the chain), and the
surviving rank must leave the aborted stage. The workers are then started again, as their process
manager would, and the job is resubmitted with ``--resume``: from the checkpoint every stage holds
(the middle's is DCP shards) it must end exactly as an uninterrupted run (the unsplit model:
per-step losses and final parameters within 1e-5), the same guarantee ``test_runtime_cluster_ranks``
pins for an end stage. A ddp middle on the same two workers equals one process with the combined
batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from nebula_common.jobspec import load_spec
from nebula_common.jobspec.reference import run_unsplit
from nebula_common.pki import PkiLayout
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.jobs import ProgramJob
from services.trainer.edge.memory import MemoryLink
from services.trainer.runtime.rank_sources import ClusterRanks
from tests.support.edges import StageRun, finish, wait_for, wait_for_step
from tests.support.ranks import gated_ranks
from tests.unit.test_runtime_cluster_ranks import Workers
from tests.unit.test_stage_chain import EXAMPLE, SETTINGS, chain_job, chain_runner, check_equals_unsplit

pytestmark = [pytest.mark.ranks, pytest.mark.timeout(1200)]
STEPS = 8
CHECKPOINT = 4  # the chain checkpoints every 2 steps; the kill comes after step 5
FAILED = trainer_pb2.STAGE_STATE_FAILED


def fsdp_middle(job_id: str, steps: int, resume_from: str = "", parallel: str = "fsdp") -> ProgramJob:
    top = {
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "lr_schedule": {"name": "constant"},  # the 200-step run and the 8-step one use the same rates
    }
    spec = chain_job(3, steps, **top).spec.model_dump(mode="json", by_alias=True)
    spec["stages"][1].update(parallel=parallel, replicas=2)
    loaded = load_spec(spec, base_dir=EXAMPLE.parent)
    if resume_from:
        return ProgramJob(loaded, job_id, resume_job_id=resume_from, resume_step=CHECKPOINT)
    return ProgramJob(loaded, job_id)


def start_chain(job: ProgramJob, work: Path, ranks: ClusterRanks) -> list[StageRun]:
    links = [MemoryLink() for _ in job.spec.edges]
    runs = [chain_runner(job, i, work, links, SETTINGS) for i in range(len(job.spec.stages))]
    runs[1].runner.cluster_ranks = ranks  # the middle stage computes on the cluster's ranks
    for run in runs:
        run.runner.start()
    return runs


@pytest.fixture
def cluster(tmp_path: Path, pki_ab: PkiLayout) -> Iterator[tuple[Workers, Path]]:
    ranks, env = gated_ranks(pki_ab, world=2)
    work = tmp_path / "work"
    workers = Workers(ranks, work / "mixer1", tmp_path, env)  # the middle's data dir: the ranks write there
    workers.start()
    try:
        wait_for(lambda: len(ranks.joined()) == ranks.world, 240, "the workers to join the rank store")
        yield workers, work
    finally:
        workers.stop()
        ranks.close()


def test_a_ddp_middle_stage_on_two_separately_started_ranks_equals_one_process(
    cluster: tuple[Workers, Path],
) -> None:
    workers, work = cluster
    runs = start_chain(fsdp_middle("ddp", STEPS, parallel="ddp"), work, workers.ranks)
    for run in runs:
        finish(run, 600)
    check_equals_unsplit(runs, run_unsplit(fsdp_middle("unsplit", STEPS).loaded), STEPS)
    assert all(process.poll() is None for process in workers.processes)  # ready for the next stage


def test_a_middle_rank_that_dies_fails_the_stage_naming_it_and_the_job_resumes_as_if_it_had_not(
    cluster: tuple[Workers, Path],
) -> None:
    workers, work = cluster
    runs = start_chain(fsdp_middle("lost", 200), work, workers.ranks)
    middle = runs[1]
    wait_for_step(middle, CHECKPOINT + 1, 300)
    assert not middle.runner.board.finished, middle.final.message  # it is training on the two ranks
    workers.processes[1].kill()  # rank 1's process dies mid-step (SIGKILL)
    for run in runs:
        finish(run, 180)
    assert [run.final.state for run in runs] == [FAILED] * 3, [run.final.message for run in runs]
    assert "a rank of the stage failed: rank(s) 1 died (no heartbeat for 2 s)" in middle.final.message, (
        middle.final.message
    )
    for end in (runs[0], runs[2]):  # the neighbours learn why, not only that an edge went away
        assert "rank(s) 1 died" in end.final.message, end.final.message
    wait_for(
        lambda: workers.processes[0].poll() is not None,
        30,
        "the surviving rank to exit (the trainer aborted its stage)",
    )
    held = {run.final.stage: run.runner.store.steps("tester", "lost", run.final.stage) for run in runs}
    assert all(CHECKPOINT in steps for steps in held.values()), held
    workers.start()  # as their process manager would: the ranks come back and join again
    resumed = start_chain(fsdp_middle("found", STEPS, resume_from="lost"), work, workers.ranks)
    for run in resumed:
        finish(run, 600)  # includes the restarted workers' start (torch import, rendezvous)
    reference = run_unsplit(fsdp_middle("unsplit", STEPS).loaded)
    check_equals_unsplit(resumed, reference, STEPS, start=CHECKPOINT)
    assert sorted(resumed[-1].losses()) == list(range(CHECKPOINT, STEPS))
