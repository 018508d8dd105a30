"""Hostile stage modules for the stage-isolation tests, and how those tests watch them end.

``hostile_job(tmp, kind, options)`` is the built-in ``numbers`` job whose encoder's ``build()`` first
does ``kind`` (``HOSTILE_BUILD``: read everything, fork-bomb, allocate without bound, spin, die, leave
children behind); ``tests/support/hostile_probe.py`` is appended to its module for ``probe``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from nebula_common.jobspec import load_spec
from nebula_common.launcher import LocalDeployment
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.client import ClusterSession, submit_job
from nebula_common.sdk.jobs import ProgramJob
from services.trainer.status import TERMINAL_STATES as TERMINAL
from tests.support.waiting import wait_for

STAGE_MAIN = "services.trainer.stage_main"  # every stage process's command line
NUMBERS = Path(__file__).resolve().parents[2] / "nebula_common/jobspec/builtin/numbers"

PROBE = (Path(__file__).resolve().parent / "hostile_probe.py").read_text()

HOSTILE_BUILD = {
    "probe": "probe(options)\n    raise RuntimeError('probe done')",
    "fork_bomb": "import os\n    while True:\n        os.fork()",
    "memory": "blocks = []\n    while True:\n        blocks.append(bytearray(64 << 20))",
    "spin": "while True:\n        pass",
    "log_flood": (
        "import sys\n"
        "    line = 'x' * 99 + '\\n'\n"
        "    for _ in range(320_000):\n"
        "        sys.stderr.write(line)\n"
        "    sys.stderr.flush()\n"
        "    raise RuntimeError('flood done')"
    ),
    "killed": "import os, signal\n    os.kill(os.getpid(), signal.SIGKILL)",
    "outlive": (
        "import os, subprocess, threading, time\n"
        "    threading.Thread(target=time.sleep, args=(600,), daemon=False).start()\n"
        "    marker = 'sleep 600 # nebula-outlive-marker'\n"
        "    subprocess.Popen(['/bin/sh', '-c', marker], start_new_session=True)\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        os.execv('/bin/sleep', ['/bin/sleep', '601'])\n"
        "    raise RuntimeError('left children behind')"
    ),
}


def require_bwrap(deployment: LocalDeployment) -> None:
    log = (deployment.log_dir / "trainer-a.log").read_text(errors="replace")
    if '"isolation": "bwrap' in log:
        return
    if os.environ.get("NEBULA_REQUIRE_BWRAP") == "1":
        pytest.fail(
            "NEBULA_REQUIRE_BWRAP=1 but trainer-a does not confine stages with bubblewrap (see its log)"
        )
    pytest.skip("trainer-a runs stages without bubblewrap here (install Debian's bubblewrap)")


def hostile_job(tmp_path: Path, kind: str, options: dict[str, Any], steps: int = 4) -> ProgramJob:
    """The numbers job whose encoder's ``build()`` does ``kind`` first (options: JSON in the spec)."""
    directory = tmp_path / kind
    directory.mkdir()
    shutil.copy(NUMBERS / "target.py", directory / "target.py")
    source = (NUMBERS / "source.py").read_text()
    source = source.replace(
        "def build(options: dict[str, Any]) -> torch.nn.Module:\n",
        "def build(options: dict[str, Any]) -> torch.nn.Module:\n    " + HOSTILE_BUILD[kind] + "\n",
    )
    (directory / "source.py").write_text(source + PROBE)
    spec = (NUMBERS / "job.yaml").read_text()
    spec = spec.replace(
        "    options: {d_model: 128, n_heads: 4, n_layers: 2}\n  - name: decoder",
        f"    options: {json.dumps({'d_model': 32, 'n_heads': 2, 'n_layers': 1, **options})}\n"
        "  - name: decoder",
    )
    (directory / "job.yaml").write_text(spec)
    return ProgramJob(load_spec(directory / "job.yaml", {"steps": steps}), f"{kind}-{secrets.token_hex(3)}")


def run_job(
    job: ProgramJob, sessions: dict[str, ClusterSession], timeout: float = 120.0
) -> dict[str, trainer_pb2.StageStatus]:
    """Submit ``job`` and wait (bounded) until its stage in every cluster has ended; their final statuses."""
    submit_job(job, sessions, measure_links=False)
    return ended(job.job_id, sessions, timeout)


def ended(
    job_id: str, sessions: dict[str, ClusterSession], timeout: float
) -> dict[str, trainer_pb2.StageStatus]:
    def finals() -> dict[str, trainer_pb2.StageStatus] | None:
        found = {}
        for session in sessions.values():
            status = stage_status(session, job_id)
            if status is None or status.state not in TERMINAL:
                return None
            found[status.stage] = status
        return found

    try:
        return wait_for(finals, timeout, f"job {job_id} ended in every cluster", interval=0.2)
    except AssertionError as exc:
        seen = {cluster: stage_status(session, job_id) for cluster, session in sessions.items()}
        raise AssertionError(f"{exc}; last seen: {seen}") from None


def stage_status(session: ClusterSession, job_id: str) -> trainer_pb2.StageStatus | None:
    reply = session.trainer.ListStages(
        trainer_pb2.ListStagesRequest(job_id=job_id), metadata=session.metadata, timeout=10
    )
    return reply.stages[0].status if reply.stages else None


def host_pids(*markers: str) -> list[int]:
    """Host processes whose command line mentions every one of ``markers``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if all(marker.encode() in cmdline for marker in markers):
                found.append(int(entry.name))
    return found


def stage_pids() -> list[int]:
    """Stage processes of this tree's interpreter: those of a deployment another checkout runs beside
    the test (a second clone's loop, say) do not count."""
    return host_pids(STAGE_MAIN, sys.prefix)
