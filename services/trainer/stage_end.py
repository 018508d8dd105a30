"""Ending a stage process: killing it and everything it started, recording how it ended, cleaning up.

Why a module of its own: every way a stage process stops (it ended, was cancelled, broke its
channel, died, never started, or the trainer drains) must leave nothing running and record one end,
and that is easier to hold true when the ways sit side by side. A process is killed with SIGKILL of
its whole session (with bubblewrap, its sandbox, whose PID namespace dies with it) and its control
group is emptied. One that died without posting an end is FAILED with its exit code or signal, or
its memory limit; a cancelled one is CANCELLED. Finish callbacks run once the process, and
everything it started, is gone; then a peer still waiting on one of its edges hears why, and the
proxy's socket goes. A drained stage (``StageProcess.drain``) has not ended: nothing is recorded,
no callback runs and its peer is not told, so the trainer's next start resumes it.

``StageEnd`` is one part of ``StageProcess`` (``stage_process``), whose ``__init__`` sets the
state used here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer.cgroup import StageGroup
from services.trainer.sandbox import StageLimits
from services.trainer.stage_edge_fds import StageEdgeFds
from services.trainer.stage_proxy import StageProxy
from services.trainer.stage_ranks import StageRanks
from services.trainer.status import StatusBoard

# The records keep the name they have always had (one logger for the trainer's side of a stage).
log = logging.getLogger("services.trainer.stage_process")
CANCEL_GRACE_S = 4.0
"""How long a cancelled stage process may take to end before it is killed."""


class StageEnd:
    """Kill, record the end, run the finish callbacks, close the proxy (part of ``StageProcess``)."""

    # Set by StageProcess.__init__ or provided by its other parts (annotations only).
    spec: trainer_pb2.StageSpec
    epoch: int
    board: StatusBoard
    _limits: StageLimits
    _callbacks: list[Callable[[], None]]
    _done: threading.Event
    _conn: Connection | None
    _process: subprocess.Popen[bytes] | None
    _proxy: StageProxy | None
    _edge_fds: StageEdgeFds | None
    _socket_dir: Path | None
    _group: StageGroup | None
    _cancelled: bool
    _draining: bool
    _ranks: StageRanks | None
    _peers: Callable[[], dict[str, str]]  # stage_launch

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
        self._stop_edge_fds()
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

    def _stop_edge_fds(self) -> None:
        """No more edge connections for a stage that is gone (those it had ended with its process)."""
        if self._edge_fds is not None:
            self._edge_fds.stop()
            self._edge_fds = None

    def _drained(self) -> None:
        self._kill()
        if self._process is not None:
            self._process.wait()
        self._release_ranks()
        if self._conn is not None:
            self._conn.close()
        self._stop_edge_fds()
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

    def _release_ranks(self) -> None:
        """The cluster's ranks it held are free, whatever it said: it is gone (``stage_ranks``)."""
        if self._ranks is not None:
            self._ranks.close()

    def _run_callbacks(self) -> None:
        self._release_ranks()
        for callback in self._callbacks:
            try:
                callback()
            except Exception:
                log.exception("stage finish callback failed", extra={"fields": {"job_id": self.spec.job_id}})
        self._done.set()


__all__ = ["CANCEL_GRACE_S", "StageEnd"]
