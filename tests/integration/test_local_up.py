"""`nebula local up` keeps two clusters running until interrupted, then stops every process it started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_local_up_runs_until_interrupted_and_leaves_nothing_behind(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    up = subprocess.Popen(
        [sys.executable, "-m", "nebula_common.cli.app", "local", "up", "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    description = run_dir / "deployment.json"
    deadline = time.monotonic() + 90
    while not description.exists() and time.monotonic() < deadline and up.poll() is None:
        time.sleep(0.2)
    assert description.exists(), up.communicate(timeout=30)[0]
    deployment = json.loads(description.read_text())
    pids = [p["pid"] for c in deployment["clusters"].values() for p in c["processes"].values()]
    assert len(pids) == 10 and all(alive(pid) for pid in pids)  # auth, codec, data, switch, trainer x2
    assert (run_dir / "pki" / "a" / "switch.crt").exists()
    assert oct((run_dir / "a" / "admin-password").stat().st_mode & 0o777) == "0o600"

    time.sleep(1.0)  # still up: it does not exit on its own
    assert up.poll() is None
    up.send_signal(signal.SIGINT)
    output, _ = up.communicate(timeout=60)
    assert up.returncode == 0, output
    for pid in pids:
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(pid), f"process {pid} survived the shutdown"
