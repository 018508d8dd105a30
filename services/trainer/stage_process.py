"""The trainer's side of a stage process: start it confined, serve its way out, mirror it, end it.

A job's stage runs a tenant's code, so it never runs in the trainer (which holds the cluster's
service identity and every running job's token). ``StageProcess`` has the interface the servicer
used of an in-process ``ProgramRunner`` (``board``, ``lifecycle.add_finish_callback``, ``start``,
``cancel``, ``join``, ``release``) and does this instead:

* starts ``python -m services.trainer.stage_main`` in the trainer's confinement (``sandbox``) with an
  empty environment and a socketpair as its only link, and hands it its spec, settings and a secret;
* serves its edges and dataset reads on a private Unix socket (``stage_proxy``) with the owner's
  token, which never enters the stage process;
* mirrors the stage's status board (every status, in order, checked to be this stage's), stores
  each epoch before the stage may open it (``on_epoch``), puts each step on ``/metrics``;
* ends it: a cancel is asked over the channel and enforced with SIGKILL of the whole sandbox
  ``CANCEL_GRACE_S`` later; a stage that posted its end but does not exit (``ENDED_GRACE_S``), or
  closed its channel, is killed the same way; one that died without an end is FAILED with its exit
  code or signal. Finish callbacks run once the process, and everything it started, is gone.
* drains it when the trainer stops (``drain``): the process is killed, but the stage has not ended:
  nothing is recorded, no callback runs and its peer is not told, exactly as if the trainer had been
  killed, so the trainer's next start resumes it from its record (``restore.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

from nebula_common.pretrained import declared_dirs
from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer import stage_channel as channel
from services.trainer.cgroup import StageGroup
from services.trainer.edge import EdgeSettings
from services.trainer.metrics import record_step
from services.trainer.runtime.chain import edge_views
from services.trainer.runtime.checkpoint import CheckpointStore
from services.trainer.sandbox import (
    INSIDE_SOCKET_DIR,
    Confinement,
    StageLimits,
    bwrap_command,
    landlock_rules,
    stage_environment,
)
from services.trainer.stage_log import relay_log
from services.trainer.stage_proxy import StageProxy
from services.trainer.status import TERMINAL_STATES, StatusBoard

log = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 60.0
"""How long a new stage process may take to say HELLO (an interpreter starting on a loaded host)."""
CANCEL_GRACE_S = 4.0
"""How long a cancelled stage process may take to end before it is killed."""
ENDED_GRACE_S = 2.0
"""How long a stage process that posted its end may take to exit (its edge's close going out)."""


class StageProcess:
    """One stage of a job in its own confined process (see the module doc)."""

    def __init__(
        self,
        spec: trainer_pb2.StageSpec,
        token: str,
        switch_address: str,
        data_dir: Path,
        owner: str,
        data_service_address: str | None = None,
        *,
        confinement: Confinement,
        limits: StageLimits,
        edge_settings: EdgeSettings | None = None,
        epoch: int = 0,
        on_epoch: Callable[[int], None] | None = None,
        receive_ahead: int | None = None,
        torch_threads: int = 1,
        log_level: str = "INFO",
        on_refusal: Callable[[str], None] | None = None,
    ) -> None:
        self.spec = spec
        self.token = token
        self.owner = owner
        self.epoch = epoch
        self.board = StatusBoard(spec.job_id, spec.stage)
        self.lifecycle = self  # the servicer registers finish callbacks here, as on a runner's lifecycle
        self.confinement = confinement
        self._limits = limits
        self._switch_address = switch_address
        self._data_address = data_service_address
        self._data_dir = Path(data_dir)
        self._edge_settings = edge_settings or EdgeSettings()
        self._on_epoch = on_epoch
        self._receive_ahead = receive_ahead
        self._torch_threads = torch_threads
        self._log_level = log_level
        self._on_refusal = on_refusal
        self._callbacks: list[Callable[[], None]] = []
        self._done = threading.Event()
        self._send_lock = threading.Lock()
        self._conn: Connection | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._proxy: StageProxy | None = None
        self._socket_dir: Path | None = None
        self._kill_at: float | None = None
        self._group: StageGroup | None = None
        self._cancelled = False
        self._draining = False
        self.pid: int | None = None

    # --- what the servicer uses ------------------------------------------------------------------

    def add_finish_callback(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def start(self) -> None:
        """Start the process and its supervision on a thread of their own (never the caller's loop)."""
        threading.Thread(target=self._run, name=f"stage-{self.spec.job_id}", daemon=True).start()

    def _run(self) -> None:
        try:
            self._spawn()
        except Exception as exc:
            log.exception("stage process did not start", extra={"fields": {"job_id": self.spec.job_id}})
            if self._process is not None:
                self._finish(f"it did not start: {type(exc).__name__}: {exc}")
            else:
                self._end_now(f"the stage process did not start: {type(exc).__name__}: {exc}")
            return
        self._supervise()

    def cancel(self) -> None:
        """Ask the stage to stop (it tells the other cluster); kill it if it has not ended in time."""
        self._cancelled = True
        self._deadline(CANCEL_GRACE_S)
        self._send(channel.CANCEL)

    def drain(self) -> None:
        """The trainer stops, not the job: end the process now and leave the stage to be resumed.

        Its record stays as it is (running, at its epoch, with its job token), its peer is not told
        (its route waits, orphaned, for the next trainer), and no finish callback runs: to the job
        this is the same as a trainer killed outright, which the restarted trainer resumes. A stage
        that has already ended is left to finish as usual.
        """
        if self.board.finished:
            return
        self._draining = True
        self._kill()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def is_alive(self) -> bool:
        return not self._done.is_set()

    def release(self) -> None:
        """Nothing of a running stage is kept here after its end (its proxy closes on its own)."""

    # --- start -----------------------------------------------------------------------------------

    def _work_dir(self) -> Path:
        """The account's directory of the data dir: its checkpoints (all its jobs', for resumes)."""
        store = CheckpointStore(self._data_dir)
        account = store.stage_dir(self.owner, self.spec.job_id, self.spec.stage).parents[2]
        account.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Absolute: it is the stage's cwd, and bubblewrap resolves its bind sources from there (a
        # relative data dir, as `make demo`'s runs/demo gives, named a path that did not exist).
        return account.resolve()

    def _read_only(self) -> list[Path]:
        """The pre-trained folders the spec's module declares (validated before the stage started)."""
        program = self.spec.program
        options: dict[str, Any] = {}
        with contextlib.suppress(ValueError):
            options = json.loads(program.options_json or "{}")
        paths = []
        for option in declared_dirs(program.module_source, program.module_name or "<stage>"):
            value = options.get(option)
            if isinstance(value, str) and value and Path(value).is_dir():
                paths.append(Path(value).resolve())
        return paths

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
        command = [sys.executable, "-m", "services.trainer.stage_main", str(theirs.fileno())]
        socket_inside = str(self._socket_dir / "edge.sock")
        tmp = "/tmp"
        rules = None
        if self.confinement.mode == "bwrap":
            command = bwrap_command(work, self._socket_dir, self._read_only(), command)
            socket_inside = f"{INSIDE_SOCKET_DIR}/edge.sock"
        elif self.confinement.mode == "landlock":
            private_tmp = self._socket_dir / "tmp"  # goes with the socket's directory at the end
            private_tmp.mkdir(mode=0o700)
            tmp = str(private_tmp)
            rules = landlock_rules(work, [self._socket_dir], self._read_only())
        try:
            self._process = subprocess.Popen(
                command,
                pass_fds=[theirs.fileno()],
                env=stage_environment(work, tmp),
                cwd=work,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        finally:
            theirs.close()
        self.pid = self._process.pid
        self._conn = Connection(ours.detach())
        assert self._process.stderr is not None
        threading.Thread(
            target=relay_log, args=(self._process.stderr, self.spec.job_id, self.spec.stage), daemon=True
        ).start()
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
            "data_dir": str(self._data_dir),
            "owner": self.owner,
            "epoch": self.epoch,
            "edge_settings": dataclasses.asdict(self._edge_settings),
            "receive_ahead": self._receive_ahead,
            "torch_threads": self._torch_threads,
            "log_level": self._log_level,
            "landlock": rules,
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

    # --- while it runs ---------------------------------------------------------------------------

    def _send(self, kind: bytes, payload: bytes = b"") -> None:
        conn = self._conn
        if conn is None:
            return
        with self._send_lock, contextlib.suppress(OSError, ValueError):  # it is gone: its end is near
            channel.send(conn, kind, payload)

    def _deadline(self, seconds: float) -> None:
        at = time.monotonic() + seconds
        if self._kill_at is None or at < self._kill_at:
            self._kill_at = at

    def _supervise(self) -> None:
        reason = ""
        conn = self._conn
        assert conn is not None
        try:
            while True:
                wait = None if self._kill_at is None else max(0.0, self._kill_at - time.monotonic())
                if not conn.poll(wait if wait is not None else 1.0):
                    if self._kill_at is not None and time.monotonic() >= self._kill_at:
                        reason = "it did not end in time after it was cancelled or ended"
                        break
                    continue
                self._handle(*channel.receive(conn))
        except EOFError:
            pass
        except (channel.ChannelError, DecodeError, ValueError, KeyError, TypeError) as exc:
            reason = f"it broke the stage channel protocol: {exc}"
        finally:
            self._finish(reason)

    def _handle(self, kind: bytes, payload: bytes) -> None:
        if kind == channel.STATUS:
            status = trainer_pb2.StageStatus.FromString(payload)
            status.job_id, status.stage = self.spec.job_id, self.spec.stage  # its own, whatever it says
            if self.board.finished:
                return  # one end only
            if self._cancelled and status.state == trainer_pb2.STAGE_STATE_SUCCEEDED:
                status.state = trainer_pb2.STAGE_STATE_CANCELLED
            self.board.publish(status)
            if status.state in TERMINAL_STATES:
                self._deadline(ENDED_GRACE_S)
        elif kind == channel.STEP:
            body = channel.parse_json(payload)
            loss = body.get("loss")
            record_step(
                self.spec.job_id,
                self.spec.stage,
                float(body["elapsed"]),
                float(body["waited"]),
                None if loss is None else float(loss),
            )
        elif kind == channel.EPOCH:
            epoch = int(channel.parse_json(payload)["epoch"])
            if epoch < self.epoch:
                raise ValueError(f"epoch {epoch} is older than {self.epoch}")
            self.epoch = epoch
            if self._on_epoch is not None:
                self._on_epoch(epoch)
            self._send(channel.EPOCH_OK)
        else:
            raise ValueError(f"unknown message kind {kind!r}")

    # --- the end ---------------------------------------------------------------------------------

    def _kill(self) -> None:
        process = self._process
        if process is None:
            return
        # Its own session (bwrap: its sandbox, whose PID namespace dies with it): nothing it started
        # outlives it. A process that left the session is in the sandbox's PID namespace all the same.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        if self._group is not None:
            left = self._group.close()
            if left:
                log.error("stage processes survived SIGKILL", extra={"fields": {"pids": left}})

    def _finish(self, reason: str) -> None:
        if self._draining and not self.board.finished:
            self._drained()
            return
        process = self._process
        code: int | None = None
        oom = False
        if process is not None:
            try:
                code = process.wait(0 if reason else CANCEL_GRACE_S)
            except subprocess.TimeoutExpired:
                reason = reason or "it closed its channel but did not exit"
            oom = self._group is not None and self._group.oom_killed()
            self._kill()
            code = process.wait()
        if self._conn is not None:
            self._conn.close()
        if not self.board.finished:
            if self._cancelled:
                self.board.update(state=trainer_pb2.STAGE_STATE_CANCELLED, message="cancelled")
            else:
                how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited ({code})"
                if code is not None and code > 128:
                    how = f"was killed by signal {code - 128}"
                why = f": {reason}" if reason else ""
                if oom:
                    why = f": it reached its memory limit ({self._limits.memory_bytes >> 20} MiB, "
                    why += "NEBULA_TRAINER_STAGE_MEMORY_MB)"
                self.board.update(
                    state=trainer_pb2.STAGE_STATE_FAILED,
                    message=f"the stage process {how} before the stage ended{why}",
                )
        elif reason:
            log.warning("stage process killed: %s", reason, extra={"fields": {"job_id": self.spec.job_id}})
        self._run_callbacks()
        self._close_proxy()

    def _close_proxy(self) -> None:
        """The stage is gone: a peer still waiting on an edge it could not close hears why (which may
        take until that peer's stage is up: after the end was recorded), then the socket goes."""
        if self._proxy is not None:
            final = self.board.latest()
            if final.state != trainer_pb2.STAGE_STATE_SUCCEEDED:
                reason = "cancelled" if final.state == trainer_pb2.STAGE_STATE_CANCELLED else final.message
                try:
                    self._proxy.tell_peers(self._peers(), self.epoch, reason)
                except Exception:  # best effort: the peer's own timeouts remain
                    log.exception(
                        "could not close the stage's edges", extra={"fields": {"job_id": self.spec.job_id}}
                    )
            self._proxy.stop()
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    def _drained(self) -> None:
        self._kill()
        if self._process is not None:
            self._process.wait()
        if self._conn is not None:
            self._conn.close()
        if self._proxy is not None:
            self._proxy.stop()  # its streams vanish, as a killed trainer's would: the routes wait
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        log.info(
            "stage left for the next start to resume",
            extra={"fields": {"job_id": self.spec.job_id, "stage": self.spec.stage, "epoch": self.epoch}},
        )
        self._done.set()

    def _end_now(self, message: str) -> None:
        self.board.update(state=trainer_pb2.STAGE_STATE_FAILED, message=message)
        self._run_callbacks()
        self._close_proxy()

    def _run_callbacks(self) -> None:
        for callback in self._callbacks:
            try:
                callback()
            except Exception:
                log.exception("stage finish callback failed", extra={"fields": {"job_id": self.spec.job_id}})
        self._done.set()


__all__ = ["CANCEL_GRACE_S", "StageProcess"]
