"""A worker's box around each stage it runs: the job's code on a cluster rank never runs in the worker.

A worker (``worker.py``) holds its cluster's ``worker`` identity, the one that gets through the rank
store's gate; a stage's module is a tenant's code. So the worker runs each stage in a process of its
own (``python -m services.trainer.rank_box_main``), confined as the trainer confines its stages
(``sandbox``): under bubblewrap where the host allows it (own user and PID namespaces, no view of the
host beyond its code, its account's directory and the pre-trained folders its spec declares), else
under Landlock it enforces on itself (containers: compose, Kubernetes), else a plain process (the
worker says so at start-up). Unlike a trainer's stage, a rank's box keeps TCP: the ranks of a stage
meet over it (gloo or NCCL), and so does the driver's command group.

What the box gets: an empty environment (but for the variables that steer gloo, NCCL and CUDA), its
limits, seccomp filter and ``PR_SET_DUMPABLE`` 0 (``stage_main.confine``), the spec on one socketpair
and its stage's keys of the rank store on another (``runtime/store_bridge``). The worker's key is
not in its view, and the worker's loopback tunnel to the rank store admits only the worker's own two
connections (``RankTunnel(max_connections=...)``), so the box cannot speak to the store as the worker.
The box dies with its worker (bubblewrap's ``--die-with-parent``, else ``PR_SET_PDEATHSIG``), and its
whole session is killed when the stage ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO

import torch.distributed as dist

from nebula_common.ports import ephemeral_range
from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer import landlock
from services.trainer.runtime.store_bridge import StoreBridge
from services.trainer.sandbox import (
    NETWORK_ENV,
    Confinement,
    StageLimits,
    bwrap_command,
    choose_confinement,
    landlock_rules,
    stage_environment,
)
from services.trainer.stage_launch import account_dir, declared_read_only

log = logging.getLogger("nebula.trainer.worker")
SETTING = "NEBULA_WORKER_STAGE_ISOLATION"
KILL_GRACE_S = 5.0
PR_SET_CHILD_SUBREAPER = 36
TAIL_LINES = 5


class RankBoxError(RuntimeError):
    """The box did not run the stage to its end (the message says how it ended)."""


@dataclass(frozen=True)
class RankBoxes:
    """How this worker boxes its stages: the confinement probed at start-up, limits, threads, timeout."""

    confinement: Confinement
    limits: StageLimits
    threads: int
    timeout: float

    @classmethod
    def probe(cls, requested: str, limits: StageLimits, threads: int, timeout: float) -> RankBoxes:
        """The strongest confinement of ``requested`` that works here, with TCP (``SandboxError`` if a
        named one does not). No control group: a worker does not manage the host's."""
        scratch = Path(tempfile.mkdtemp(prefix="nebula-rank-probe-"))
        try:
            confinement = choose_confinement(requested, scratch, network=True, setting=SETTING)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        no_groups = "a worker makes no control groups: its pod's or container's limits hold the boxes"
        confinement = Confinement(
            confinement.mode,
            confinement.weaker_because,
            no_groups,
            confinement.landlock_abi or landlock.abi(),  # bubblewrap's boxes get its TCP rule too
            confinement.seccomp_missing,
            network=True,
        )
        return cls(confinement, limits, threads, timeout)

    def run(
        self, spec_bytes: bytes, rank: int, world: int, stage: dist.Store, data_dir: Path, owner: str
    ) -> None:
        """Run this rank's part of the stage in a box; return when it ended well, else ``RankBoxError``."""
        spec = trainer_pb2.StageSpec.FromString(spec_bytes)
        work = account_dir(data_dir, spec, owner)
        private = Path(tempfile.mkdtemp(prefix="nebula-rank-box-"))
        control, control_theirs = socket.socketpair()
        store, store_theirs = socket.socketpair()
        command = [
            sys.executable,
            "-m",
            "services.trainer.rank_box_main",
            str(control_theirs.fileno()),
            str(store_theirs.fileno()),
            "0" if self.confinement.mode == "bwrap" else str(os.getpid()),
        ]
        read_only = declared_read_only(spec)
        tmp, rules = "/tmp", None
        mode = self.confinement.mode
        if mode == "bwrap":
            command = bwrap_command(work, None, read_only, command, network=True)
            if self.confinement.landlock_abi >= landlock.TCP_ABI:  # and Landlock's TCP rule inside
                rules = {"tcp_ports": list(ephemeral_range())}
        elif mode == "landlock":
            tmp = str(private)
            rules = landlock_rules(work, [private], read_only, network=True)
        env = stage_environment(work, tmp)
        env.update({name: os.environ[name] for name in NETWORK_ENV if name in os.environ})
        passed = [control_theirs, store_theirs]
        try:
            process = subprocess.Popen(
                command,
                pass_fds=[each.fileno() for each in passed],
                env=env,
                cwd=work,
                stdin=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        finally:
            for each in passed:
                each.close()
        tail: deque[str] = deque(maxlen=TAIL_LINES)
        assert process.stderr is not None
        relay = threading.Thread(
            target=_relay, args=(process.stderr, tail), name="rank-box-stderr", daemon=True
        )
        relay.start()
        conn = Connection(control.detach())
        bridge = StoreBridge(Connection(store.detach()), stage, name=f"rank-{rank}-store-bridge")
        try:
            config = {
                "rank": rank,
                "world": world,
                "data_dir": str(data_dir.resolve()),
                "owner": owner,
                "threads": self.threads,
                "timeout": self.timeout,
                "limits": self.limits.as_dict(),
                "seccomp": not self.confinement.seccomp_missing,
                "landlock": rules,
            }
            conn.send_bytes(json.dumps(config).encode())
            conn.send_bytes(spec_bytes)
            code = process.wait()
        finally:
            _end_session(process)
            bridge.stop()
            conn.close()
            shutil.rmtree(private, ignore_errors=True)
        relay.join(KILL_GRACE_S)
        if code != 0:
            how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
            refused = f"; its store bridge dropped it: {bridge.refused}" if bridge.refused else ""
            said = f"; its stderr ended: {tail[-1]}" if tail else ""
            limits = (
                f" (its limits: {self.limits.memory_bytes >> 20} MiB of address space, "
                "NEBULA_WORKER_STAGE_MEMORY_MB; "
                f"{self.limits.cpu_seconds} CPU seconds, NEBULA_WORKER_STAGE_CPU_SECONDS)"
            )
            raise RankBoxError(f"the stage's box on rank {rank} {how}{refused}{said}{limits}")

    def describe(self) -> str:
        return self.confinement.describe()


def _relay(stream: IO[bytes], tail: deque[str]) -> None:
    """The box's stderr into the worker's (its log), keeping the last lines for a failure's message."""
    for raw in stream:
        line = raw.decode(errors="replace").rstrip()
        sys.stderr.write(line + "\n")
        if line.strip():
            tail.append(line[:500])
    stream.close()


def adopt_orphans() -> None:
    """Make this worker the reaper of its boxes' orphans (``PR_SET_CHILD_SUBREAPER``): a stage's process
    that left its box's session (``setsid``) and lost its parent becomes this worker's child, and so is
    found and killed when its stage ends (``_end_session``), Landlock's boxes having no PID namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log.warning("cannot become the reaper of the stage boxes' orphans: errno %d", ctypes.get_errno())


def _children() -> list[int]:
    """This process's children, from /proc (each process's parent is field 4 of its ``stat``)."""
    mine, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == mine:
                    found.append(int(entry))
    return found


def _end_session(process: subprocess.Popen[bytes]) -> None:
    """Kill whatever the box left: its session (a stage's own children), then every process that came
    to this worker as an orphan (the worker has no child but its boxes); reap them all."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(KILL_GRACE_S)
    deadline = time.monotonic() + KILL_GRACE_S
    while (left := _children()) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        time.sleep(0.05)
    if left:
        log.error("processes %s of a stage's box outlived it by %.0f s", left, KILL_GRACE_S)


__all__ = ["SETTING", "RankBoxError", "RankBoxes", "adopt_orphans"]
