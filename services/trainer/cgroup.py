"""A control group per stage process, where the host lets the trainer make one: processes and memory.

Why: rlimits are per process (a fork bomb multiplies them) and ``RLIMIT_NPROC`` counts a user, not
a sandbox; the kernel's ``pids`` and ``memory`` controllers bound the stage and everything it starts
together, and their member list is how the trainer knows that nothing of an ended stage is left.
cgroup v2 (one unified hierarchy) and v1 (one hierarchy per controller) are both handled; where
neither is writable (an unprivileged trainer, most containers) the stage runs without one and the
trainer says so at start-up (``available()``). The stage process is moved in before it is told to
start, so nothing of the job's code ever runs outside its group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PARENT = "nebula-stages"


def _is_v2(root: Path) -> bool:
    return (root / "cgroup.controllers").exists()


def _own_v2_path(root: Path) -> Path:
    """This process's v2 group (``0::/path`` in /proc/self/cgroup)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return root / line[3:].lstrip("/")
    return root


class StageGroup:
    """The control group(s) of one stage process; ``close()`` kills what is left and removes them."""

    def __init__(
        self, name: str, *, max_processes: int, memory_bytes: int, root: Path = ROOT, parent: str = PARENT
    ) -> None:
        self.paths: list[Path] = []
        if _is_v2(root):
            path = _own_v2_path(root) / parent / name
            path.mkdir(parents=True, exist_ok=True)
            (path / "pids.max").write_text(str(max_processes))
            with contextlib.suppress(OSError):  # the memory controller may not be delegated here
                (path / "memory.max").write_text(str(memory_bytes))
            self.paths.append(path)
            return
        pids = root / "pids" / parent / name
        pids.mkdir(parents=True, exist_ok=True)
        (pids / "pids.max").write_text(str(max_processes))
        self.paths.append(pids)
        memory = root / "memory" / parent / name
        with contextlib.suppress(OSError):
            memory.mkdir(parents=True, exist_ok=True)
            (memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
            self.paths.append(memory)

    def add(self, pid: int) -> None:
        """Move ``pid`` and every process below it (a sandbox's own init, the stage) into the group."""
        for member in [pid, *descendants(pid)]:
            for path in self.paths:
                with contextlib.suppress(ProcessLookupError):
                    (path / "cgroup.procs").write_text(str(member))

    def members(self) -> list[int]:
        found: set[int] = set()
        for path in self.paths:
            with contextlib.suppress(OSError):
                found.update(int(p) for p in (path / "cgroup.procs").read_text().split())
        return sorted(found)

    def oom_killed(self) -> bool:
        """Whether the memory limit killed a process of the stage (``oom_kill`` in v2's memory.events,
        v1's memory.oom_control)."""
        for path in self.paths:
            for name in ("memory.events", "memory.oom_control"):
                with contextlib.suppress(OSError, ValueError):
                    for line in (path / name).read_text().splitlines():
                        key, _, value = line.partition(" ")
                        if key == "oom_kill" and int(value) > 0:
                            return True
        return False

    def close(self, deadline_s: float = 5.0) -> list[int]:
        """SIGKILL every member until none is left (or the deadline); remove the groups; the survivors."""
        end = time.monotonic() + deadline_s
        left = self.members()
        while left and time.monotonic() < end:
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
            left = self.members()
        for path in self.paths:
            with contextlib.suppress(OSError):
                path.rmdir()
        return left


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (from /proc's parent links), nearest first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    frontier = [pid]
    while frontier:
        below = [c for p in frontier for c in children.get(p, [])]
        found += below
        frontier = below
    return found


def available(root: Path = ROOT, parent: str = PARENT) -> str:
    """Why the trainer cannot make stage groups here ("" when it can): tried for real."""
    try:
        group = StageGroup(
            f"probe-{os.getpid()}", max_processes=64, memory_bytes=1 << 30, root=root, parent=parent
        )
    except OSError as exc:
        return f"no writable cgroup pids controller ({exc.strerror or exc})"
    group.close()
    return ""


__all__ = ["StageGroup", "available"]
