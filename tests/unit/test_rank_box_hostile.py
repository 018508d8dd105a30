"""A hostile stage on cluster ranks: its code runs in a box on each worker and reaches nothing of theirs.

Two workers (``python -m services.trainer.worker``, as ``test_runtime_cluster_ranks`` starts them) run a
stage whose module, once loaded in a rank's box, tries: the worker's key and its identity folder, the
worker's environment, another account's file and a write outside its own account's directory, the
trainer's rank store on its loopback port (plain TCP: no gate), the gate itself without a
certificate, the global keys of the rank store through its own store, and the process list. It writes
what it found into its account's directory and then trains as the module it extends; the stage
succeeds and every attempt failed, under bubblewrap and under Landlock (the containers' mode).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nebula_common.jobspec import load_spec
from nebula_common.pki import PkiLayout
from nebula_common.ports import ephemeral_range
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.jobs import ProgramJob
from tests.support.edges import finish, wait_for
from tests.support.ranks import gated_ranks
from tests.unit.test_runtime_cluster_ranks import Workers, run_on_ranks
from tests.unit.test_runtime_sharded_stage import EXAMPLE, small

pytestmark = [pytest.mark.ranks, pytest.mark.timeout(600)]

PROBE = """

import gc as _gc
import json as _json
import os as _os
import socket as _socket

_TARGETS = json.loads(__TARGETS__)
ORPHAN = "nebula-rank-orphan"


def _attempt(name, action, found):
    try:
        found[name] = "ALLOWED: " + str(action())[:200]
    except BaseException as exc:  # a denial is what this test wants
        found[name] = f"denied: {type(exc).__name__}: {exc}"[:300]


def _connect(port):
    with _socket.create_connection(("127.0.0.1", port), timeout=3) as sock:
        return f"connected to {port}"


def _store_as_stranger(port):
    import datetime
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=3))
    return store.check(["worker/0"])


def _global_keys():
    stores = [o for o in _gc.get_objects() if type(o).__name__ == "BridgedStore"]
    if not stores:
        raise LookupError("no store in this process")
    read = stores[0].check(["worker/0"]) or stores[0].check(["stage/posted"])
    if not read:
        raise PermissionError("the global keys are not in this stage's store")
    return "read a global key"


def _probe():
    found = {}
    tls = _TARGETS["tls_dir"]
    _attempt("worker key", lambda: open(f"{tls}/service.key").read(), found)
    _attempt("worker identity folder", lambda: _os.listdir(tls), found)
    for pid in _TARGETS["worker_pids"]:
        environ, mem = f"/proc/{pid}/environ", f"/proc/{pid}/mem"
        _attempt(f"environment of worker {pid}", lambda path=environ: open(path, "rb").read(), found)
        _attempt(f"memory of worker {pid}", lambda path=mem: open(path, "rb").read(1), found)
    _attempt("another account's file", lambda: open(_TARGETS["other_file"]).read(), found)
    _attempt("a write outside its account", lambda: open(_TARGETS["outside"], "w").write("x"), found)
    store, gate = _TARGETS["store_port"], _TARGETS["gate_port"]
    _attempt("the trainer's rank store (loopback, no gate)", lambda: _connect(store), found)
    _attempt("the rank store's gate without a certificate", lambda: _store_as_stranger(gate), found)
    _attempt("the rank store's global keys through its own store", _global_keys, found)

    def workers_visible():
        pids = {int(p) for p in _os.listdir("/proc") if p.isdigit()}
        seen = pids & set(_TARGETS["worker_pids"])
        if not seen:
            raise PermissionError(f"no worker among the {len(pids)} processes it sees")
        return f"sees workers {sorted(seen)}"

    _attempt("the workers in the process list", workers_visible, found)
    with open(f"hostile-{_os.urandom(6).hex()}.json", "w") as out:
        _json.dump(found, out)
    _leave_behind()


def _leave_behind():
    # A process that leaves the box's session and loses its parent, to outlive the stage.
    import subprocess
    import sys

    if _os.fork() == 0:
        _os.setsid()
        sleeper = [sys.executable, "-c", "import time; time.sleep(3600)", ORPHAN]
        subprocess.Popen(sleeper, start_new_session=True, stdin=-3, stdout=-3, stderr=-3)
        _os._exit(0)


if _os.environ.get("USER") == "stage":  # in a rank's box (the driver loads this module too)
    _probe()
"""


@pytest.fixture(params=["bwrap", "landlock"])
def cluster(
    request: pytest.FixtureRequest, tmp_path: Path, pki_ab: PkiLayout
) -> Iterator[tuple[Workers, Path, dict[str, str]]]:
    ranks, env = gated_ranks(pki_ab, world=2)
    env = {**env, "NEBULA_WORKER_STAGE_ISOLATION": request.param}
    work = tmp_path / "work"
    workers = Workers(ranks, work / "head", tmp_path, env)
    workers.start()
    wait_for(lambda: len(ranks.joined()) == ranks.world, 240, "the workers to join the rank store")
    try:
        yield workers, work, env
    finally:
        workers.stop()
        ranks.close()


def hostile_job(
    tmp_path: Path,
    targets: dict[str, object],
    fields: dict[str, object] | None = None,
    job_id: str = "hostile-ranks",
) -> ProgramJob:
    """The digit-sum job whose labels stage probes its box first (``fields``: the job's settings)."""
    folder = tmp_path / "job"
    folder.mkdir()
    for name in ("job.yaml", "features.py"):
        (folder / name).write_text((EXAMPLE.parent / name).read_text())
    labels = (EXAMPLE.parent / "labels.py").read_text()
    labels = labels.replace("from typing import Any", "import json\nfrom typing import Any")
    (folder / "labels.py").write_text(labels + PROBE.replace("__TARGETS__", repr(json.dumps(targets))))
    fields = fields or {
        "steps": 4,
        "data.batch_size": 32,
        "data.micro_batches": 2,
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "lr_schedule": {"name": "constant"},
        "checkpoint.interval": 2,
    }
    return ProgramJob(load_spec(folder / "job.yaml", fields), job_id)


def test_a_hostile_stage_on_the_ranks_reaches_nothing_of_its_workers_and_still_trains(
    cluster: tuple[Workers, Path, dict[str, str]], tmp_path: Path
) -> None:
    workers, work, env = cluster
    data_dir = work / "head"
    other = data_dir / "accounts" / "other" / "secret.txt"
    other.parent.mkdir(parents=True)
    other.write_text("another account's")
    targets = {
        "tls_dir": env["NEBULA_WORKER_INTERNAL_TLS_DIR"],
        "worker_pids": [process.pid for process in workers.processes],
        "other_file": str(other),
        "outside": str(data_dir / "planted.txt"),
        "store_port": workers.ranks.store.port,
        "gate_port": workers.ranks.port,
    }
    low, high = ephemeral_range()  # a box connects only inside it: the store must be outside
    assert not low <= workers.ranks.store.port <= high, workers.ranks.store.port
    up, down = run_on_ranks(hostile_job(tmp_path, targets), work, workers.ranks)
    for run in (up, down):
        finish(run, 240)
    assert down.final.state == trainer_pb2.STAGE_STATE_SUCCEEDED, down.final.message
    account = data_dir / "accounts" / "tester"
    reports = sorted(account.glob("hostile-*.json"))
    assert len(reports) == 2, f"each rank's box should have reported: {reports}"
    for report in reports:
        found = json.loads(report.read_text())
        assert len(found) == 12, found
        # Under bubblewrap a write outside lands in the box's own empty root, not on the host: checked below.
        allowed = {name: said for name, said in found.items() if not said.startswith("denied")}
        allowed.pop("a write outside its account", None)
        assert not allowed, allowed
    assert not (data_dir / "planted.txt").exists()
    assert all(process.poll() is None for process in workers.processes)  # ready for the next stage
    wait_for(lambda: not orphans(), 5, "the processes the stage left behind to be killed with it")


def orphans() -> list[int]:
    """Processes of this host whose command line carries the probe's orphan marker."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"nebula-rank-orphan" in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.fixture
def starved(tmp_path: Path, pki_ab: PkiLayout) -> Iterator[Workers]:
    """Workers whose boxes get 256 MiB of address space: too little to import torch."""
    ranks, env = gated_ranks(pki_ab, world=2)
    workers = Workers(
        ranks, tmp_path / "work" / "head", tmp_path, {**env, "NEBULA_WORKER_STAGE_MEMORY_MB": "256"}
    )
    workers.start()
    wait_for(lambda: len(ranks.joined()) == ranks.world, 240, "the workers to join the rank store")
    try:
        yield workers
    finally:
        workers.stop()
        ranks.close()


def test_a_box_that_cannot_start_fails_the_stage_at_once_naming_the_rank_and_why(
    starved: Workers, tmp_path: Path
) -> None:
    started = time.monotonic()
    up, down = run_on_ranks(small("starved"), tmp_path / "work", starved.ranks)
    finish(down, 120)
    up.runner.cancel()  # the reader would wait out its peer's outage otherwise
    finish(up, 60)
    assert down.final.state == trainer_pb2.STAGE_STATE_FAILED
    message = down.final.message
    assert "the stage's ranks did not start" in message and "the stage's box on rank" in message, message
    assert "256 MiB of address space, NEBULA_WORKER_STAGE_MEMORY_MB" in message, message
    assert time.monotonic() - started < 60, "the driver waited out the command group's timeout"
