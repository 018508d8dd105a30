"""The trainer's side of a stage process: start it confined, serve its way out, mirror it, end it.

A job's stage runs a tenant's code, so it never runs in the trainer (which holds the cluster's
service identity and every running job's token). ``StageProcess`` has the interface the servicer
used of an in-process ``ProgramRunner`` (``board``, ``lifecycle.add_finish_callback``, ``start``,
``cancel``, ``join``, ``release``) and does this instead:

* starts ``python -m services.trainer.stage_main`` in the trainer's confinement (``sandbox``) with an
  empty environment and a socketpair as its link (and, with a switch edge socket, a second pair for its
  edge connections: ``stage_edge_fds``), and hands it its spec, settings and a secret;
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

It is one class over one process's state, set here; its parts are base classes in modules of one
concern each, naming (as annotations only) what they use of that state and of each other:

* ``stage_launch`` (``StageLaunch``): its work dir, read-only folders and edges, and starting it in
  its confinement up to START and SPEC (``STARTUP_TIMEOUT_S``);
* ``stage_supervision`` (``StageSupervision``): the channel's messages while it runs, and the kill
  deadline (``ENDED_GRACE_S``);
* ``stage_end`` (``StageEnd``): killing it and everything it started, recording its end, the finish
  callbacks, telling its peers and closing its proxy, or leaving it to be resumed (``CANCEL_GRACE_S``).

This module keeps the servicer's interface and the thread that starts and then supervises it.
"""

from __future__ import annotations

import logging
import subprocess
import threading
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer import stage_channel as channel
from services.trainer.cgroup import StageGroup
from services.trainer.edge import EdgeSettings
from services.trainer.runtime.rank_sources import ClusterRanks
from services.trainer.sandbox import Confinement, StageLimits
from services.trainer.stage_edge_fds import StageEdgeFds
from services.trainer.stage_end import CANCEL_GRACE_S, StageEnd
from services.trainer.stage_launch import LAST_WORDS_LINES, STARTUP_TIMEOUT_S, StageLaunch
from services.trainer.stage_proxy import StageProxy
from services.trainer.stage_ranks import StageRanks
from services.trainer.stage_supervision import ENDED_GRACE_S, StageSupervision
from services.trainer.status import StatusBoard

log = logging.getLogger(__name__)


class StageProcess(StageLaunch, StageSupervision, StageEnd):
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
        switch_edge_socket: str = "",
        cluster_ranks: ClusterRanks | None = None,
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
        self._switch_edge_socket = switch_edge_socket
        self._edge_fds: StageEdgeFds | None = None
        self._cluster_ranks = cluster_ranks
        """The cluster's ranks this stage's compute runs on, driven from its box (``stage_ranks``)."""
        self._ranks: StageRanks | None = None
        self._stderr_tail: deque[str] = deque(maxlen=LAST_WORDS_LINES)
        self._stderr_relay: threading.Thread | None = None
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
                # EOF on the channel says only that it died: its exit and stderr say how.
                what = f"{type(exc).__name__}: {exc}" if str(exc) else "it closed its channel before HELLO"
                self._finish(f"it did not start ({what}){self._last_words()}")
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


__all__ = ["CANCEL_GRACE_S", "ENDED_GRACE_S", "STARTUP_TIMEOUT_S", "StageProcess"]
