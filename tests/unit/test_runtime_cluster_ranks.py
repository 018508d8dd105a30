"""A stage across processes started on their own: ``python -m services.trainer.worker`` ranks, torchrun-style.

Two worker processes are started separately (each with the variables torchrun sets: RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE; this test hosts the store as
torchrun's agent does), form their own gloo group by c10d rendezvous and join the
trainer's rank store through its mutual-TLS gate (each with a ``worker`` certificate of the cluster);
the stage's runner (which alone holds the edge) drives them. The stage
trains exactly like one process with the combined batch; a rank that dies fails the stage naming
it, the surviving rank leaves the aborted stage at once (for its process manager to restart), and
the restarted ranks resume the job from its checkpoint. A stage the trainer did not sign (written
into the store by job code on a worker, say) is refused by every rank and never run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from nebula_common.pki import PkiLayout
from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer.edge.memory import MemoryLink
from services.trainer.runtime.rank_sources import LOST_AFTER_S, ClusterRanks
from tests.support.edges import StageRun, finish, stage_runner, wait_for, wait_for_step
from tests.support.ranks import gated_ranks
from tests.unit.test_runtime_sharded_stage import SETTINGS, reference, same_training, small

pytestmark = [pytest.mark.ranks, pytest.mark.timeout(600)]
__all__ = ["reference"]  # the one-process run every test here compares with (a fixture)
ROOT = Path(__file__).resolve().parents[2]


class Workers:
    """``world`` worker processes (our own children, ended by handle) joined to one ClusterRanks."""

    def __init__(self, ranks: ClusterRanks, data_dir: Path, logs: Path, env: dict[str, str]) -> None:
        self.ranks, self.data_dir, self.logs, self.env = ranks, data_dir, logs, env
        self.processes: list[subprocess.Popen[bytes]] = []
        self.agent_store: dist.TCPStore | None = None

    def start(self) -> None:
        # A fresh store per start, held on its port by this process, as torchrun's agent does (a port
        # probed free and released could be taken by anyone before rank 0 bound it).
        self.agent_store = dist.TCPStore(
            "127.0.0.1", 0, self.ranks.world + 1, is_master=True, wait_for_workers=False
        )
        port = self.agent_store.port
        for rank in range(self.ranks.world):
            env = {
                **self.env,  # its identity for the rank store's gate
                "PYTHONPATH": str(ROOT),
                "RANK": str(rank),
                "WORLD_SIZE": str(self.ranks.world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "NEBULA_WORKER_TRAINER": f"127.0.0.1:{self.ranks.port}",
                "NEBULA_WORKER_DATA_DIR": str(self.data_dir),
            }
            log = (self.logs / f"worker-{rank}-{len(self.processes)}.log").open("wb")
            self.processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "services.trainer.worker"],
                    env=env,
                    stdout=log,
                    stderr=log,
                    cwd=ROOT,
                )
            )

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


@pytest.fixture
def cluster(tmp_path: Path, pki_ab: PkiLayout) -> Iterator[tuple[Workers, Path]]:
    ranks, env = gated_ranks(pki_ab, world=2)
    work = tmp_path / "work"
    workers = Workers(ranks, work / "head", tmp_path, env)
    workers.start()
    wait_for(lambda: len(ranks.joined()) == ranks.world, 240, "the workers to join the rank store")
    try:
        yield workers, work
    finally:
        workers.stop()
        ranks.close()


def run_on_ranks(job: object, work: Path, ranks: ClusterRanks) -> tuple[StageRun, StageRun]:
    link = MemoryLink()
    runs = [stage_runner(job, i, work, link, SETTINGS) for i in (0, 1)]  # type: ignore[arg-type]
    runs[1].runner.cluster_ranks = ranks  # the loss-owning stage runs on the cluster's ranks
    for run in runs:
        run.runner.start()
    return runs[0], runs[1]


@pytest.mark.parametrize(("replicas", "parallel"), [(1, "ddp"), (2, "fsdp")])
def test_a_stage_on_two_separately_started_ranks_equals_one_process_with_the_combined_batch(
    cluster: tuple[Workers, Path], reference: tuple[StageRun, StageRun], replicas: int, parallel: str
) -> None:
    workers, work = cluster
    job = small(f"ranks-{parallel}", **{"stages.1.replicas": replicas, "stages.1.parallel": parallel})
    up, down = run_on_ranks(job, work, workers.ranks)
    for run in (up, down):
        finish(run, 120)
    same_training((up, down), reference)
    assert all(process.poll() is None for process in workers.processes)  # ready for the next stage


def test_a_rank_that_dies_fails_the_stage_naming_it_and_the_other_ranks_leave_it(
    cluster: tuple[Workers, Path],
) -> None:
    workers, work = cluster
    job = small("dies", **{"steps": 200, "checkpoint.interval": 3})
    up, down = run_on_ranks(job, work, workers.ranks)
    wait_for_step(down, 4, 120)
    assert not down.runner.board.finished, down.final.message  # it is training on the two ranks
    workers.processes[1].kill()  # rank 1's process dies mid-step (kill -9)
    for run in (up, down):
        finish(run, 120)
    assert down.final.state == trainer_pb2.STAGE_STATE_FAILED
    assert "a rank of the stage failed: rank(s) 1 died (no heartbeat for 2 s)" in down.final.message, (
        down.final.message
    )
    wait_for(
        lambda: workers.processes[0].poll() is not None,
        30,
        "the surviving rank to exit (the trainer aborted its stage)",
    )
    assert workers.processes[0].returncode == 1


def test_a_rank_whose_host_froze_fails_the_stage_by_its_heartbeat_not_the_collective_timeout(
    cluster: tuple[Workers, Path],
) -> None:
    """A host that stops (power, kernel, partition) closes no socket: only the heartbeat tells."""
    workers, work = cluster
    up, down = run_on_ranks(small("frozen", **{"steps": 200}), work, workers.ranks)
    wait_for_step(down, 4, 120)
    assert not down.runner.board.finished, down.final.message
    frozen = freeze(workers.processes[1].pid)  # rank 1's worker and its box, sockets left open
    try:
        started = time.monotonic()
        for run in (up, down):
            finish(run, 90)  # the group's collective timeout is 300 s
        took = time.monotonic() - started
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert down.final.state == trainer_pb2.STAGE_STATE_FAILED
    said = down.final.message
    assert "a rank of the stage failed: rank(s) 1 died (no heartbeat" in said, said
    assert took < LOST_AFTER_S + 60, took
    wait_for(lambda: workers.processes[0].poll() is not None, 30, "the surviving rank to exit")


def freeze(root: int) -> list[int]:
    """SIGSTOP ``root`` and every process below it (children first found, then theirs); their pids."""
    found, queue = [], [root]
    while queue:
        pid = queue.pop()
        os.kill(pid, signal.SIGSTOP)
        found.append(pid)
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                        queue.append(int(entry.name))
    return found


def test_after_a_rank_died_the_restarted_ranks_resume_the_job_from_its_checkpoint(
    cluster: tuple[Workers, Path], reference: tuple[StageRun, StageRun]
) -> None:
    workers, work = cluster
    up, down = run_on_ranks(small("lost", **{"steps": 200}), work, workers.ranks)
    wait_for_step(down, 4, 120)
    assert not down.runner.board.finished, down.final.message
    workers.processes[1].kill()
    for run in (up, down):
        finish(run, 120)
    assert down.final.state == trainer_pb2.STAGE_STATE_FAILED
    wait_for(lambda: workers.processes[0].poll() is not None, 30, "the surviving rank to exit")
    held = {run.final.stage: run.runner.store.steps("tester", "lost", run.final.stage) for run in (up, down)}
    assert all(3 in steps for steps in held.values()), held
    workers.start()  # as their process manager would: the ranks come back and join again
    up, down = run_on_ranks(small("found", "lost"), work, workers.ranks)  # job submit --resume lost
    for run in (up, down):
        finish(run, 300)  # includes the ranks' restart
    same_training((up, down), reference, first=3)


def test_a_stage_the_trainer_did_not_sign_is_refused_by_every_rank_and_the_next_one_runs(
    cluster: tuple[Workers, Path], reference: tuple[StageRun, StageRun]
) -> None:
    workers, work = cluster
    ranks = workers.ranks
    number = ranks.store.add("stage/posted", 1) - 1  # as job code on a worker could, through its tunnel
    forged = dist.PrefixStore(f"stage/{number}", ranks.store)
    forged.set("owner", "mallory")
    forged.set("spec", b"anything at all")
    wait_for(
        lambda: all(forged.check([f"error/{rank}"]) for rank in range(ranks.world)),
        60,
        "both ranks to refuse the unsigned stage",
    )
    assert "signer is not a certificate" in forged.get("error/0").decode()
    assert all(process.poll() is None for process in workers.processes)  # refused, not crashed
    up, down = run_on_ranks(small("after-forgery"), work, ranks)
    for run in (up, down):
        finish(run, 120)
    same_training((up, down), reference)
