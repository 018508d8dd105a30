"""A stage on the cluster's ranks, driven from a real stage box: hostile, and training like one process.

The loss-owning stage of the small digit-sum job runs as the trainer runs it (``StageProcess`` under
bubblewrap or Landlock, its edge as records on switch b's edge socket, its owner's token kept by the
trainer) with the cluster's two ranks (workers behind the rank store's gate); its upstream is a stage
thread in cluster a, real switches between. Its module, once loaded in the driver's box and in each
rank's box, tries the workers' key and identity folder, the environment and memory of the workers and
of this process (the trainer, which holds the rank store), another account's file, a write outside its
account, the rank store's loopback port (plain TCP: no gate), the gate without a certificate, the
global keys through its own store, and the process list (``test_rank_box_hostile.PROBE``). Every
attempt fails in all three boxes, and the stage trains like one process with the combined batch.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from nebula_common.ports import ephemeral_range
from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer.sandbox import StageLimits, choose_confinement
from services.trainer.stage_process import StageProcess
from tests.support.edges import StageRun, SwitchPair, finish, stage_runner, wait_for
from tests.unit.test_rank_box_hostile import hostile_job, orphans
from tests.unit.test_runtime_cluster_ranks import Workers, cluster
from tests.unit.test_runtime_sharded_stage import SETTINGS, SMALL, STEPS, reference

pytestmark = [pytest.mark.ranks, pytest.mark.timeout(600)]
__all__ = ["cluster", "reference"]  # fixtures
ATTEMPTS = 14
"""What the probe tries in each box: 12, and the trainer's (this process's) environment and memory."""


@pytest.mark.parametrize("mode", ["bwrap", "landlock"])
def test_a_hostile_stage_driven_from_its_box_reaches_nothing_and_trains_like_one_process(
    mode: str,
    cluster: tuple[Workers, Path],
    reference: tuple[StageRun, StageRun],
    switches: SwitchPair,
    tmp_path: Path,
) -> None:
    workers, work = cluster
    data_dir = work / "head"  # the workers' NEBULA_WORKER_DATA_DIR: the trainer's data dir
    other = data_dir / "accounts" / "other" / "secret.txt"
    other.parent.mkdir(parents=True)
    other.write_text("another account's")
    targets = {
        "tls_dir": workers.env["NEBULA_WORKER_INTERNAL_TLS_DIR"],
        "worker_pids": [process.pid for process in workers.processes] + [os.getpid()],
        "other_file": str(other),
        "outside": str(data_dir / "planted.txt"),
        "store_port": workers.ranks.store.port,
        "gate_port": workers.ranks.port,
    }
    low, high = ephemeral_range()
    assert not low <= workers.ranks.store.port <= high, workers.ranks.store.port
    job = hostile_job(tmp_path, targets, SMALL, f"hostile-driver-{os.urandom(3).hex()}")
    up = stage_runner(job, 0, tmp_path / "a", switches, SETTINGS)  # cluster a, a stage thread
    confinement = choose_confinement(mode, Path(tempfile.mkdtemp(prefix="nebula-probe-")))
    assert confinement.mode == mode
    down = StageProcess(
        job.stage_spec(job.spec.stages[1].name),
        switches.tokens[1],
        switches.addresses[1],
        data_dir,
        "tester",
        confinement=confinement,
        limits=StageLimits(memory_bytes=8 << 30, cpu_seconds=3600, open_files=4096),
        edge_settings=SETTINGS,
        switch_edge_socket=switches.edge_sockets[1],
        cluster_ranks=workers.ranks,
    )
    down.start()
    up.runner.start()
    finish(up, 240)
    down.join(240)
    final = down.board.latest()
    assert final.state == trainer_pb2.STAGE_STATE_SUCCEEDED, final.message
    losses = {int(s.steps_done) - 1: s.loss for s in down.board.since(0, 0)[1] if s.HasField("loss")}
    want = reference[1].losses()
    assert sorted(losses) == list(range(STEPS))
    for step in range(STEPS):
        assert losses[step] == pytest.approx(want[step], abs=1e-5), step
    reports = sorted((data_dir / "accounts" / "tester").glob("hostile-*.json"))
    assert len(reports) == 3, f"the driver's box and each rank's box should have reported: {reports}"
    for report in reports:
        found = json.loads(report.read_text())
        assert len(found) == ATTEMPTS, found
        allowed = {name: said for name, said in found.items() if not said.startswith("denied")}
        allowed.pop("a write outside its account", None)  # under bubblewrap: the box's own empty root
        assert not allowed, (report.name, allowed)
    assert not (data_dir / "planted.txt").exists()
    assert not workers.ranks._busy.locked()  # the ranks are free for the next stage
    assert all(process.poll() is None for process in workers.processes)
    wait_for(lambda: not orphans(), 10, "the processes the stage's boxes left behind to be killed")
