"""Starting a stage process confined: what it may see, its empty environment, its one link, its START.

Why a module of its own: this is where a tenant's code gets its boundaries (the sandbox's binds or
Landlock rules, its control group, its limits, no token), so it should be read in one place, apart
from the supervision of a process that is already running. The stage process is
``python -m services.trainer.stage_main`` in the trainer's confinement (``sandbox``) with an empty
environment and a socketpair as its link: its edges and dataset reads go to a private Unix
socket (``stage_proxy``) that holds the owner's token, which never enters the stage process; with a
switch edge socket its edges instead go as records on connections it asks for on a second pair
(``stage_edge_fds``: checked, ticketed and connected here, passed as descriptors). Its
interpreter says HELLO and waits; only then, with every process of the sandbox in the stage's
group, does it get its settings, the proxy's secret and its spec (START, SPEC).

``StageLaunch`` is one part of ``StageProcess`` (``stage_process``), whose ``__init__`` sets the
state used here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from nebula_common.ports import ephemeral_range
from nebula_common.pretrained import declared_dirs
from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer import landlock
from services.trainer import stage_channel as channel
from services.trainer.cgroup import StageGroup
from services.trainer.edge import EdgeSettings
from services.trainer.runtime.chain import edge_views
from services.trainer.runtime.checkpoint import CheckpointStore
from services.trainer.runtime.rank_sources import ClusterRanks
from services.trainer.sandbox import (
    INSIDE_SOCKET_DIR,
    NETWORK_ENV,
    Confinement,
    StageLimits,
    bwrap_command,
    landlock_rules,
    stage_environment,
)
from services.trainer.stage_edge_fds import StageEdgeFds
from services.trainer.stage_log import relay_log
from services.trainer.stage_proxy import StageProxy
from services.trainer.stage_ranks import StageRanks

# The records keep the name they have always had (one logger for the trainer's side of a stage).
log = logging.getLogger("services.trainer.stage_process")
STARTUP_TIMEOUT_S = 60.0
LAST_WORDS_S = 5.0
"""How long a stage that failed to start is given to exit and its stderr to be read, for its message."""
LAST_WORDS_LINES = 5
"""How long a new stage process may take to say HELLO (an interpreter starting on a loaded host)."""


def declared_read_only(spec: trainer_pb2.StageSpec) -> list[Path]:
    """The pre-trained folders the spec's module declares (validated before the stage started): what
    a stage's box may read beside its code and its account's directory."""
    program = spec.program
    options: dict[str, Any] = {}
    with contextlib.suppress(ValueError):
        options = json.loads(program.options_json or "{}")
    paths = []
    for option in declared_dirs(program.module_source, program.module_name or "<stage>"):
        value = options.get(option)
        if isinstance(value, str) and value and Path(value).is_dir():
            paths.append(Path(value).resolve())
    return paths


def account_dir(data_dir: Path, spec: trainer_pb2.StageSpec, owner: str) -> Path:
    """The account's directory of the data dir, made if missing (absolute: a box's cwd and bind source)."""
    store = CheckpointStore(data_dir)
    account = store.stage_dir(owner, spec.job_id, spec.stage).parents[2]
    account.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Absolute: it is the stage's cwd, and bubblewrap resolves its bind sources from there (a
    # relative data dir, as `make demo`'s runs/demo gives, named a path that did not exist).
    return account.resolve()


class StageLaunch:
    """Its work dir, read-only folders and edges, and starting it (part of ``StageProcess``)."""

    # Set by StageProcess.__init__ (annotations only: nothing here shadows them).
    spec: trainer_pb2.StageSpec
    token: str
    owner: str
    epoch: int
    confinement: Confinement
    pid: int | None
    _limits: StageLimits
    _switch_address: str
    _data_address: str | None
    _data_dir: Path
    _edge_settings: EdgeSettings
    _receive_ahead: int | None
    _torch_threads: int
    _log_level: str
    _on_refusal: Callable[[str], None] | None
    _send_lock: threading.Lock
    _conn: Connection | None
    _process: subprocess.Popen[bytes] | None
    _proxy: StageProxy | None
    _switch_edge_socket: str
    _edge_fds: StageEdgeFds | None
    _socket_dir: Path | None
    _group: StageGroup | None
    _stderr_tail: deque[str]
    _stderr_relay: threading.Thread | None
    _cluster_ranks: ClusterRanks | None
    _ranks: StageRanks | None

    def _last_words(self, deadline_s: float = LAST_WORDS_S) -> str:
        """Why a stage that never started ended, in its own words: its exit and last stderr lines.

        Waits (up to ``deadline_s``) for the process to exit and its stderr to be read to the end, so
        the words are the last ones; what is still missing then is not waited for."""
        process = self._process
        if process is None:
            return ""
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(deadline_s)
        if self._stderr_relay is not None and process.returncode is not None:
            self._stderr_relay.join(deadline_s)
        words = " | ".join(self._stderr_tail)
        return f"; its stderr ended: {words}" if words else "; it wrote nothing to stderr"

    def _work_dir(self) -> Path:
        """The account's directory of the data dir: its checkpoints (all its jobs', for resumes)."""
        return account_dir(self._data_dir, self.spec, self.owner)

    def _read_only(self) -> list[Path]:
        return declared_read_only(self.spec)

    def _peers(self) -> dict[str, str]:
        """Each edge of the stage and the cluster at its other end."""
        views = edge_views(self.spec) if self.spec.program.role == "middle" else (self.spec,)
        return {view.edge: view.peer_cluster for view in views}

    def _edges(self) -> set[str]:
        return set(self._peers())

    def _spawn(self) -> None:
        work = self._work_dir()
        self._socket_dir = Path(tempfile.mkdtemp(prefix="nebula-stage-"))
        secret = secrets.token_urlsafe(32)
        self._proxy = StageProxy(
            str(self._socket_dir / "edge.sock"),
            secret=secret,
            token=lambda: self.token,
            job_id=self.spec.job_id,
            edges=self._edges(),
            switch_address=self._switch_address,
            data_address=self._data_address,
            dataset=self.spec.program.dataset,
            on_refusal=self._on_refusal,
        )
        self._proxy.start()
        ours, theirs = socket.socketpair()
        passed = [theirs]
        edge_fd: int | None = None  # the stage's end of its edge requests' pair (the same number inside)
        if self._switch_edge_socket:  # its edges as records: connections asked for on a pair of their own
            edge_ours, edge_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            passed.append(edge_theirs)
            edge_fd = edge_theirs.fileno()
            self._edge_fds = StageEdgeFds(edge_ours, self._proxy, self._switch_edge_socket, self.spec.job_id)
            self._edge_fds.start()
        ranks_config = None
        if self._cluster_ranks is not None:  # its driver's ranks, through this trainer (``stage_ranks``)
            self._ranks = StageRanks(
                self._cluster_ranks,
                self.spec,
                self.owner,
                lambda body: self._send(channel.RANKS_REPLY, json.dumps(body).encode()),
            )
            passed += self._ranks.box_ends
            ranks_config = {
                "fds": [end.fileno() for end in self._ranks.box_ends],
                "world": self._cluster_ranks.world,
                "timeout": self._cluster_ranks.timeout,
            }
        network = ranks_config is not None  # a driver meets its ranks over TCP (gloo)
        command = [sys.executable, "-m", "services.trainer.stage_main", str(theirs.fileno())]
        socket_inside = str(self._socket_dir / "edge.sock")
        tmp = "/tmp"
        rules = None
        if self.confinement.mode == "bwrap":
            command = bwrap_command(work, self._socket_dir, self._read_only(), command, network=network)
            socket_inside = f"{INSIDE_SOCKET_DIR}/edge.sock"
            if network and landlock.abi() >= landlock.TCP_ABI:  # and Landlock's TCP rule inside
                rules = {"tcp_ports": list(ephemeral_range())}
        elif self.confinement.mode == "landlock":
            private_tmp = self._socket_dir / "tmp"  # goes with the socket's directory at the end
            private_tmp.mkdir(mode=0o700)
            tmp = str(private_tmp)
            rules = landlock_rules(work, [self._socket_dir], self._read_only(), network=network)
        env = stage_environment(work, tmp)
        if network:
            env.update({name: os.environ[name] for name in NETWORK_ENV if name in os.environ})
        try:
            self._process = subprocess.Popen(
                command,
                pass_fds=[each.fileno() for each in passed],
                env=env,
                cwd=work,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        finally:
            for each in passed:
                each.close()
        self.pid = self._process.pid
        self._conn = Connection(ours.detach())
        assert self._process.stderr is not None
        self._stderr_relay = threading.Thread(
            target=relay_log,
            args=(self._process.stderr, self.spec.job_id, self.spec.stage),
            kwargs={"tail": self._stderr_tail},
            daemon=True,
        )
        self._stderr_relay.start()
        # HELLO: the stage's interpreter runs and waits for START, so every process of the sandbox
        # exists and none of the job's code has run; all of them go into the stage's group now.
        if not self._conn.poll(STARTUP_TIMEOUT_S):
            raise TimeoutError(f"the stage process said nothing within {STARTUP_TIMEOUT_S:.0f} s")
        kind, _ = channel.receive(self._conn)
        if kind != channel.HELLO:
            raise channel.ChannelError(f"the stage process began with {kind!r}, not HELLO")
        if not self.confinement.cgroups_missing:
            name = f"{self.spec.job_id}.{self.spec.stage}.{self.pid}"
            self._group = StageGroup(
                name,
                max_processes=self._limits.processes,
                memory_bytes=self._limits.memory_bytes,
                parent=self.confinement.cgroup_parent,
            )
            self._group.add(self.pid)
        config = {
            "secret": secret,
            "socket": socket_inside,
            "edge_fds": edge_fd,
            "data_dir": str(self._data_dir),
            "owner": self.owner,
            "epoch": self.epoch,
            "edge_settings": dataclasses.asdict(self._edge_settings),
            "receive_ahead": self._receive_ahead,
            "torch_threads": self._torch_threads,
            "log_level": self._log_level,
            "landlock": rules,
            "ranks": ranks_config,
            "seccomp": not self.confinement.seccomp_missing,
            # Memory: the control group's limit where there is one (a stage past it is OOM-killed and
            # its end says so); else the address-space rlimit (a MemoryError inside the stage).
            "limits": {
                **self._limits.as_dict(),
                "memory_bytes": self._limits.memory_bytes if self.confinement.cgroups_missing else 0,
            },
        }
        with self._send_lock:
            channel.send_json(self._conn, channel.START, config)
            channel.send(self._conn, channel.SPEC, self.spec.SerializeToString())
        log.info(
            "stage process started",
            extra={
                "fields": {
                    "job_id": self.spec.job_id,
                    "stage": self.spec.stage,
                    "pid": self.pid,
                    "isolation": self.confinement.mode,
                }
            },
        )


__all__ = ["LAST_WORDS_S", "STARTUP_TIMEOUT_S", "StageLaunch", "account_dir", "declared_read_only"]
