"""A stage's ranks started by ``torchrun`` itself (c10d rendezvous through its agent's store).

``torchrun --nnodes 1 --nproc-per-node N --rdzv-backend c10d -m services.trainer.worker`` starts the
ranks, as an operator would on each host of a cluster; they form their group through torchrun's own
agent store (not MASTER_ADDR/PORT set by hand, which ``test_runtime_cluster_ranks.py`` covers), pick
the backend by device (gloo on the CPU, NCCL with CUDA) and join the trainer's rank store. Two
torchrun-started workers train a ddp and then an fsdp stage exactly like one process with the
combined batch (1e-5), staying up between stages. NCCL needs two CUDA devices; without them that
test is skipped saying so.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from nebula_common.pki import PkiLayout
from services.trainer.runtime.rank_sources import ClusterRanks
from tests.support.edges import StageRun, finish, wait_for
from tests.support.ranks import gated_ranks
from tests.unit.test_runtime_cluster_ranks import run_on_ranks
from tests.unit.test_runtime_sharded_stage import reference, same_training, small

pytestmark = [pytest.mark.ranks, pytest.mark.timeout(600)]
__all__ = ["reference"]  # the one-process run with the combined batch (a fixture)
ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")


class Torchrun:
    """One ``torchrun`` agent (our own child, in its own process group) running ``nproc`` workers."""

    def __init__(
        self, ranks: ClusterRanks, data_dir: Path, log: Path, nproc: int, tls: dict[str, str]
    ) -> None:
        if TORCHRUN is None:
            pytest.skip("torchrun is not installed next to this Python (it ships with torch)")
        env = {
            **tls,  # the environment with the workers' identity for the rank store's gate
            "PYTHONPATH": str(ROOT),
            "NEBULA_WORKER_TRAINER": f"127.0.0.1:{ranks.port}",
            "NEBULA_WORKER_DATA_DIR": str(data_dir),
            "OMP_NUM_THREADS": "1",
        }
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
            env.pop(name, None)  # torchrun sets them; nothing from outside may leak in
        self.log = log
        command = [
            TORCHRUN,
            "--nnodes=1",
            f"--nproc-per-node={nproc}",
            "--standalone",  # c10d rendezvous on a port the agent binds itself (a probed one could be taken)
            "--max-restarts=0",
            "-m",
            "services.trainer.worker",
        ]
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                command, env=env, stdout=out, stderr=out, cwd=ROOT, start_new_session=True
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # the agent and the workers it started
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)


def _start(tmp_path: Path, nproc: int, pki: PkiLayout) -> Iterator[tuple[Torchrun, ClusterRanks, Path]]:
    ranks, env = gated_ranks(pki, world=nproc)
    work = tmp_path / "work"
    agent = Torchrun(ranks, work / "head", tmp_path / "torchrun.log", nproc, env)
    try:
        wait_for(
            lambda: len(ranks.joined()) == nproc or agent.process.poll() is not None,
            240,
            "the torchrun-started workers to join the rank store",
        )
        assert agent.process.poll() is None, f"torchrun exited:\n{agent.text()[-3000:]}"
        yield agent, ranks, work
    finally:
        agent.stop()
        ranks.close()


@pytest.fixture(scope="module")
def torchrun(
    tmp_path_factory: pytest.TempPathFactory, pki_ab: PkiLayout
) -> Iterator[tuple[Torchrun, ClusterRanks, Path]]:
    """Two workers under one torchrun agent, kept for every stage of this module (as in a cluster)."""
    yield from _start(tmp_path_factory.mktemp("torchrun"), 2, pki_ab)


def _groups(log: str) -> list[tuple[str, str, str]]:
    """(rank, backend, device) of every worker's group, from the workers' log lines."""
    return re.findall(r"rank (\d+) of \d+: (\w+) group on (\w+) \(c10d rendezvous through torchrun", log)


@pytest.mark.parametrize(("replicas", "parallel"), [(1, "ddp"), (2, "fsdp")])
def test_two_torchrun_started_workers_train_like_one_process_with_the_combined_batch(
    torchrun: tuple[Torchrun, ClusterRanks, Path],
    reference: tuple[StageRun, StageRun],
    replicas: int,
    parallel: str,
) -> None:
    agent, ranks, work = torchrun
    job = small(f"torchrun-{parallel}", **{"stages.1.replicas": replicas, "stages.1.parallel": parallel})
    up, down = run_on_ranks(job, work, ranks)
    for run in (up, down):
        finish(run, 180)
    same_training((up, down), reference)
    assert sorted(_groups(agent.text())) == [("0", "gloo", "cpu"), ("1", "gloo", "cpu")]
    assert agent.process.poll() is None, "the workers stay up for the next stage"


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason=f"NCCL ranks need 2 CUDA devices; this machine has {torch.cuda.device_count()}",
)
def test_on_cuda_the_torchrun_started_workers_use_nccl(
    torchrun: tuple[Torchrun, ClusterRanks, Path], reference: tuple[StageRun, StageRun]
) -> None:
    agent, ranks, work = torchrun
    # On CUDA a stage on rank processes is sharded (a ddp stage stays on the CPU, see rank_main.py).
    job = small("torchrun-nccl", **{"stages.1.replicas": 2, "stages.1.parallel": "fsdp"})
    up, down = run_on_ranks(job, work, ranks)
    for run in (up, down):
        finish(run, 180)
    same_training((up, down), reference)
    assert sorted(_groups(agent.text())) == [("0", "nccl", "cuda"), ("1", "nccl", "cuda")]
