"""The trainer's side of a boxed stage's cluster ranks: it posts the stage, bridges its keys, says why.

A stage whose compute runs on the cluster's ranks (``runtime/rank_sources.ClusterRanks``) is driven
from its own stage process like any other stage (``stage_process``): the job's module never loads in
the trainer, which holds the rank store, its gate's key and the key that signs the specs the workers
run. What the driver needs of the ranks it asks over its stage channel (``RANKS``); this class answers
on a thread of its own, in order:

* ``attach``: post this attempt of the stage, signed, and bridge the box's store to that stage's keys
  (``stage/<n>/``, on two socketpairs: ``runtime/store_bridge``, the second for its ``clone``). The
  spec posted is the trainer's copy of the stage's, or its resume from one of the stage's own
  checkpoints: the box names only the step. It never reaches the rank store, the gate, another
  stage's keys or the keys the trainer posts a stage with (``POSTED``).
* ``why``: which ranks died (their heartbeats, read here) and what the others said;
* ``finish``: wait for every rank's ``done`` and mark the stage finished; ``abort``: free the ranks.

When the stage process ends, however it ends, the ranks it held are freed (``close``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer.runtime.rank_sources import AttachedRanks, ClusterRanks
from services.trainer.runtime.resume import resumed_spec
from services.trainer.runtime.store_bridge import StoreBridge

log = logging.getLogger(__name__)
OPERATIONS = ("attach", "why", "finish", "abort")
MAX_FINISH_S = 60.0
"""The longest a box may have the trainer wait for its ranks' ``done`` (the driver asks for 30 s)."""
MAX_ERROR_CHARS = 2000
MAX_PENDING = 8
"""Requests of one box waiting for the ranks' thread; a box that sends more breaks the protocol (its
driver asks one at a time, and an abort may follow a request)."""


class StageRanks:
    """One stage process's use of the cluster's ranks (see the module doc).

    ``reply`` sends one answer to the box (``RANKS_REPLY``). ``box_ends`` are the sockets the box
    gets (its store and the store's clone); the caller closes them once they are passed."""

    def __init__(
        self,
        cluster: ClusterRanks,
        spec: trainer_pb2.StageSpec,
        owner: str,
        reply: Callable[[dict[str, Any]], None],
    ) -> None:
        self.cluster = cluster
        self.spec = spec
        self.owner = owner
        self._reply = reply
        pairs = [socket.socketpair() for _ in range(2)]
        self.box_ends = [theirs for _, theirs in pairs]
        self._bridges = [
            StoreBridge(Connection(ours.detach()), None, name=f"stage-{spec.job_id}-ranks-{i}")
            for i, (ours, _) in enumerate(pairs)
        ]
        self._attached: AttachedRanks | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._pending = 0
        self._work = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage-{spec.job_id}-ranks")

    def handle(self, body: dict[str, Any]) -> None:
        """One request of the box, answered in order on the ranks' thread (an attach may wait minutes
        for the workers to join: never on the supervision thread). ValueError for one that is not
        of this protocol: the box broke it."""
        op = body.get("op")
        if op not in OPERATIONS:
            raise ValueError(f"not a ranks operation: {str(op)[:80]!r}")
        with self._lock:
            if self._closed:
                return
            if self._pending >= MAX_PENDING:
                raise ValueError(f"more than {MAX_PENDING} requests for the ranks unanswered")
            self._pending += 1
            self._work.submit(self._answer, str(op), body)

    def close(self) -> None:
        """The stage process is gone: free its ranks (an attach still waiting frees them when it ends)."""
        with self._lock:
            self._closed = True
        self._work.shutdown(wait=False, cancel_futures=True)
        self._release()
        for bridge in self._bridges:
            bridge.stop()

    def _answer(self, op: str, body: dict[str, Any]) -> None:
        try:
            self._answer_one(op, body)
        finally:
            with self._lock:
                self._pending -= 1

    def _answer_one(self, op: str, body: dict[str, Any]) -> None:
        if op == "abort":
            self._release()
            return
        try:
            if op == "attach":
                result = self._attach(body.get("resume_step"))
            elif op == "why":
                result = {"why": self._why(str(body.get("error", ""))[:MAX_ERROR_CHARS])}
            else:
                result = {"finished": self._finish(body.get("timeout"))}
        except Exception as exc:  # the box hears why; its stage fails saying so
            result = {"error": f"{type(exc).__name__}: {exc}"}
        if not self._closed:
            with contextlib.suppress(OSError):  # the box is gone: close() follows
                self._reply({"op": op, "id": body.get("id"), **result})

    def _attach(self, resume_step: object) -> dict[str, Any]:
        self._release()  # a re-attempt: the last attempt's ranks first
        if resume_step is None:
            spec = self.spec
        elif isinstance(resume_step, int) and not isinstance(resume_step, bool) and resume_step >= 0:
            spec = resumed_spec(self.spec, resume_step)
        else:
            raise ValueError(f"resume_step must be a step number or null, got {str(resume_step)[:40]!r}")
        attached = self.cluster.attach(spec.SerializeToString(), self.owner)
        with self._lock:
            closed = self._closed
            if not closed:
                self._attached = attached
        if closed:
            attached.abort()
            raise RuntimeError("the stage ended while its ranks were being attached")
        for bridge in self._bridges:
            bridge.use(attached.store)
        hosts = [str(worker.get("host", "?")) for worker in self.cluster.joined()]
        return {"world": attached.world, "hosts": hosts}

    def _why(self, error: str) -> str:
        attached = self._attached
        if attached is None:
            return error
        return attached.why(RuntimeError(error))

    def _finish(self, timeout: object) -> bool:
        attached = self._attached
        if attached is None:
            raise RuntimeError("no ranks are attached to finish")
        number = isinstance(timeout, int | float) and not isinstance(timeout, bool)
        seconds = float(timeout) if number else 0.0  # type: ignore[arg-type]
        if not math.isfinite(seconds):  # JSON's NaN and Infinity
            seconds = 0.0
        attached.finish(min(max(seconds, 0.0), MAX_FINISH_S))
        return True

    def _release(self) -> None:
        with self._lock:
            attached, self._attached = self._attached, None
        for bridge in self._bridges:
            bridge.use(None)
        if attached is not None:
            attached.abort()


__all__ = ["StageRanks"]
