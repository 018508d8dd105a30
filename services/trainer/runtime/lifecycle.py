"""The life of one stage on a trainer: its thread, cancellation, status board and terminal state.

Why one small module: every way a stage can end must reach the watchers and the
other cluster the same way, whatever the stage computes. The body (the training
loop) only trains and returns; this module decides how it ended:

* the body returned: SUCCEEDED (the body closes its edge cleanly itself, after
  flushing what it still has to send);
* ``cancel()``: the edge is aborted with reason "cancelled" at once, so a body
  blocked waiting for the other cluster wakes up (its receive raises
  ``EdgeClosedError``); the stage ends CANCELLED with message "cancelled";
* the edge closed under it (peer failed, link dropped) or anything else raised:
  the edge is aborted with the reason, so the other cluster's stage fails at
  once instead of waiting for tensors that will never come; the stage ends
  FAILED with that reason as its message; except when the other cluster's stage closed it
  because *it* was cancelled (a job is cancelled in both clusters, and one stage often hears
  of it from its peer first): the stage ends CANCELLED too, with message ``PEER_CANCELLED``.

Recovery is the body's own business (``stage.py``): it catches ``EdgeRestartRequired`` and
``EdgeOutage``, posts the non-terminal RECOVERING and starts a new attempt; only when it gives
up (``max_recoveries``) or the edge ended otherwise does an ``EdgeClosedError`` reach this
module, which then ends the stage FAILED as above (or CANCELLED when it was cancelled,
including while recovering).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer.edge import EdgeClosedError
from services.trainer.status import StatusBoard

log = logging.getLogger(__name__)
CANCELLED_REASON = "cancelled"
PEER_CANCELLED = "cancelled: the other cluster's stage was cancelled"
# How the edge session words a peer's close of a cancelled stage (``session.py``: an error close).
_PEER_CANCEL_CLOSE = f"peer side failed: {CANCELLED_REASON}"


class StageCancelled(Exception):
    """Raised inside a stage's body at a point where it noticed ``cancel()`` had been called."""


class StageLifecycle:
    """Runs ``body`` on its own thread and turns however it ends into one terminal status.

    ``abort`` hooks (the stage's edge, once it is open) are called with the reason when the
    stage is cancelled or fails; ``cleanup`` runs after the terminal status is posted (e.g.
    reaping data-parallel replicas, which may take a while and must not delay the peer).
    Finish callbacks (``add_finish_callback``) run last, on the stage's own thread, so whoever
    keeps the stage learns of its end without parking a thread of its own in ``join()``.
    """

    def __init__(
        self,
        job_id: str,
        stage: str,
        body: Callable[[], None],
        cleanup: Callable[[], None] | None = None,
    ) -> None:
        self.job_id = job_id
        self.stage = stage
        self.board = StatusBoard(job_id, stage)
        self._body = body
        self._cleanup = cleanup
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self._abort: Callable[[str], None] | None = None
        self._on_finish: list[Callable[[], None]] = []
        self._thread = threading.Thread(target=self._run, name=f"stage-{job_id}", daemon=True)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def add_finish_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` on the stage thread once it has ended (terminal status posted, cleanup done).

        Register before ``start()``. A callback that raises is logged; the others still run.
        """
        self._on_finish.append(callback)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def cancel(self) -> None:
        """Stop at once, even while the body is blocked waiting for the other cluster."""
        with self._lock:
            self._cancelled.set()
            abort = self._abort
        if abort is not None:
            abort(CANCELLED_REASON)

    def attach_abort(self, abort: Callable[[str], None]) -> None:
        """Register how to tear the stage's edge down; raises ``StageCancelled`` if already cancelled.

        Called by the body right after it opens its edge: a cancel that came before the
        edge existed could not abort it, so it is honoured here instead.
        """
        with self._lock:
            self._abort = abort
        self.raise_if_cancelled()

    def release(self) -> None:
        """Forget the body's edge abort once the stage has ended, so the runner kept for its status
        board does not keep the edge (and its buffers and codecs) alive."""
        with self._lock:
            self._abort = None

    def raise_if_cancelled(self) -> None:
        """The body's check between steps (a cancel between two steps has nothing to wake up)."""
        if self._cancelled.is_set():
            raise StageCancelled

    def _abort_edge(self, reason: str) -> None:
        with self._lock:
            abort = self._abort
        if abort is not None:
            abort(reason)

    def _run(self) -> None:
        try:
            self._run_body()
        finally:
            try:
                if self._cleanup is not None:
                    self._cleanup()
            finally:
                self._finished()

    def _finished(self) -> None:
        for callback in self._on_finish:
            try:
                callback()
            except Exception:
                log.exception("stage finish callback failed", extra={"fields": {"job_id": self.job_id}})

    def _run_body(self) -> None:
        fields = {"job_id": self.job_id, "stage": self.stage}
        try:
            self._body()
        except StageCancelled:
            self._abort_edge(CANCELLED_REASON)
            self.board.update(state=trainer_pb2.STAGE_STATE_CANCELLED, message=CANCELLED_REASON)
        except EdgeClosedError as exc:
            if self._cancelled.is_set():  # our own cancel() closed the edge under the body
                self.board.update(state=trainer_pb2.STAGE_STATE_CANCELLED, message=CANCELLED_REASON)
                return
            if str(exc) == _PEER_CANCEL_CLOSE:  # the job was cancelled, the peer's stage first
                self._abort_edge(CANCELLED_REASON)
                self.board.update(state=trainer_pb2.STAGE_STATE_CANCELLED, message=PEER_CANCELLED)
                return
            log.error("stage failed: %s", exc, extra={"fields": fields})
            self._abort_edge(str(exc))
            self.board.update(state=trainer_pb2.STAGE_STATE_FAILED, message=str(exc))
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            log.exception("stage crashed", extra={"fields": fields})
            self._abort_edge(reason)
            self.board.update(state=trainer_pb2.STAGE_STATE_FAILED, message=reason)
        else:
            self.board.update(state=trainer_pb2.STAGE_STATE_SUCCEEDED)


__all__ = ["CANCELLED_REASON", "PEER_CANCELLED", "StageCancelled", "StageLifecycle"]
