"""Helpers for tests that start ``nebula cluster up`` / ``local up`` as processes and inspect them.

``wait_description`` waits for the deployment.json a deployment writes once its services are up;
``pids`` lists every service process it names; ``alive`` and ``assert_gone`` check processes by pid;
``references`` is what the isolation checks of the two-organisation tests read: the paths a process
was configured with or holds open.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def wait_description(up: subprocess.Popen[str], run_dir: Path, deadline_s: float) -> dict[str, Any]:
    """RUN_DIR/deployment.json once ``up`` wrote it; fails with ``up``'s output if it exits or times out."""
    description = run_dir / "deployment.json"
    deadline = time.monotonic() + deadline_s
    while not description.exists() and time.monotonic() < deadline and up.poll() is None:
        time.sleep(0.2)
    if not description.exists():
        up.terminate()
        raise AssertionError(
            f"deployment in {run_dir} wrote no deployment.json within {deadline_s:.0f}s:\n"
            f"{up.communicate(timeout=60)[0]}"
        )
    return json.loads(description.read_text())


def pids(description: dict[str, Any]) -> list[int]:
    """The pid of every service process of every cluster in a deployment description."""
    return [p["pid"] for c in description["clusters"].values() for p in c["processes"].values()]


def references(pid: int) -> list[str]:
    """Paths process ``pid`` was configured with (its environment) or holds open (its fds)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    opened = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            opened.append(os.readlink(fd))
    return environ + opened


def alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (a zombie counts until its parent reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def assert_gone(pids: Iterable[int], what: str = "the shutdown", each_s: float = 10.0) -> None:
    """Every process of ``pids`` exits, each within ``each_s`` s; else fails naming one that survived."""
    for pid in pids:
        deadline = time.monotonic() + each_s
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(pid), f"process {pid} survived {what}"
