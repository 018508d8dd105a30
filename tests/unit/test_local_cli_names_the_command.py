"""`nebula local status|down` name the command holding the run directory (`local up` or `cluster up`).

A real child process holds the run directory's lock (the launcher's own ``lock_run_dir``) and writes
a deployment.json the way ``nebula cluster up`` does; the CLI commands run in this process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nebula_common.cli.local import app
from nebula_common.launcher.run_dir import running_deployment_pid

pytestmark = pytest.mark.timeout(60)

HOLDER = """
import json, os, signal, sys, time
from pathlib import Path
from nebula_common.launcher.run_dir import lock_run_dir
run_dir = Path(sys.argv[1])
if sys.argv[3] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
lock = lock_run_dir(run_dir)
command = {"name": sys.argv[2], "pid": os.getpid()}
(run_dir / "deployment.json").write_text(json.dumps({"command": command, "clusters": {}}))
print("ready", flush=True)
time.sleep(120)
"""


def _invoke(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output + result.stderr
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def _hold(
    holders: list[subprocess.Popen[str]], run_dir: Path, name: str, on_term: str = "default"
) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir), name, on_term],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    holders.append(process)
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 20
    while running_deployment_pid(run_dir) != process.pid:
        assert time.monotonic() < deadline, f"pid {process.pid} never showed as holding {run_dir}"
        time.sleep(0.05)
    return process


def test_status_and_down_name_cluster_up(tmp_path: Path, holders: list[subprocess.Popen[str]]) -> None:
    holder = _hold(holders, tmp_path, "nebula cluster up")
    code, out, _ = _invoke("status", "--run-dir", tmp_path)
    assert code == 0 and f"is up (`nebula cluster up`, pid {holder.pid})" in out, out
    assert "local up" not in out
    code, out, _ = _invoke("status", "--run-dir", tmp_path, "--json")
    assert code == 0 and json.loads(out)["command"] == "nebula cluster up"

    code, out, err = _invoke("down", "--run-dir", tmp_path, "--timeout", "20")
    assert code == 0, out + err
    assert out.strip() == f"stopped `nebula cluster up` in {tmp_path} (pid {holder.pid})"
    assert holder.wait(timeout=20) == -signal.SIGTERM

    code, out, _ = _invoke("status", "--run-dir", tmp_path, "--json")
    assert code == 3 and json.loads(out)["command"] is None


def test_down_that_times_out_names_the_command(tmp_path: Path, holders: list[subprocess.Popen[str]]) -> None:
    holder = _hold(holders, tmp_path, "nebula local up", on_term="ignore-term")
    code, _, err = _invoke("down", "--run-dir", tmp_path, "--timeout", "1")
    assert code == 1
    assert f"Error: `nebula local up` (pid {holder.pid}) still running after 1s" in err, err


def test_a_description_left_by_another_process_is_not_believed(
    tmp_path: Path, holders: list[subprocess.Popen[str]]
) -> None:
    holder = _hold(holders, tmp_path, "nebula cluster up")
    stale = {"command": {"name": "nebula local up", "pid": holder.pid + 1}, "clusters": {}}
    (tmp_path / "deployment.json").write_text(json.dumps(stale))
    code, out, _ = _invoke("status", "--run-dir", tmp_path)
    assert code == 0 and f"is up (the deployment, pid {holder.pid})" in out, out
