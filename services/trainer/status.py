"""Thread-safe status of a running stage, watched by any number of gRPC streams.

The training loop runs on a plain thread; watchers live on the asyncio loop.
Every update is kept (up to a bound) so a watcher sees each step's numbers,
even one that attaches late or polls slowly, and never misses the final state.

Watchers on the asyncio loop wait with ``wait_since``: the updating thread wakes
them with ``loop.call_soon_threadsafe``, so a watcher holds no thread while it
waits (a thread per watcher, or per poll, exhausted asyncio's default executor
under many stages and stalled every other call of the trainer that needed it).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable

from nebula_common.proto.nebula.v1 import trainer_pb2

TERMINAL_STATES = frozenset(
    {
        trainer_pb2.STAGE_STATE_SUCCEEDED,
        trainer_pb2.STAGE_STATE_FAILED,
        trainer_pb2.STAGE_STATE_CANCELLED,
    }
)
"""A stage ends in one of these. RECOVERING is not among them: a recovering stage restarts from the last
common checkpoint by itself and goes back to RUNNING (or ends FAILED/CANCELLED), so watchers keep
watching it."""
HISTORY_LIMIT = 100_000
PER_STEP = ("loss", "local_loss")
"""Values of one step: an update that does not set them clears them (a message or a recovery is no step),
except the terminal update, which keeps the last step's (a finished job shows its final loss, also in the
stage record the trainer writes from it, so `nebula job list|status` show it after the deployment stopped).
The step time (``step_seconds``) is never cleared, so it stays the last step's too."""


class StatusBoard:
    def __init__(self, job_id: str, stage: str) -> None:
        self._condition = threading.Condition()
        first = trainer_pb2.StageStatus(job_id=job_id, stage=stage, state=trainer_pb2.STAGE_STATE_PENDING)
        self._history: list[trainer_pb2.StageStatus] = [first]
        self._dropped = 0  # updates evicted from the front of the history
        self._last_step: dict[str, float] = {}  # the newest value of each PER_STEP field
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = set()
        self._listeners: list[Callable[[trainer_pb2.StageStatus], None]] = []

    def subscribe(self, listener: Callable[[trainer_pb2.StageStatus], None]) -> None:
        """Call ``listener`` with every new status, in order, on the updating thread (after the lock).

        A stage process forwards its board to the trainer's copy this way (``stage_process``). Listeners
        run under the board's lock, so they see statuses in the history's order; they must not update it.
        """
        self._listeners.append(listener)

    @property
    def _version(self) -> int:
        return self._dropped + len(self._history)

    def update(self, **fields: object) -> None:
        with self._condition:
            status = trainer_pb2.StageStatus()
            status.CopyFrom(self._history[-1])
            self._apply(status, fields)
            self._append_locked(status)
        self._notify()

    def publish(self, status: trainer_pb2.StageStatus) -> None:
        """Append a status computed elsewhere (a stage process's board), as it is."""
        with self._condition:
            for per_step in PER_STEP:
                if status.HasField(per_step):
                    self._last_step[per_step] = getattr(status, per_step)
            self._append_locked(status)
        self._notify()

    def _apply(self, status: trainer_pb2.StageStatus, fields: dict[str, object]) -> None:
        terminal = fields.get("state", status.state) in TERMINAL_STATES
        for per_step in PER_STEP:
            if per_step in fields:
                continue
            if terminal and per_step in self._last_step:  # the end keeps the last step's loss
                setattr(status, per_step, self._last_step[per_step])
            else:  # otherwise per-step values never carry over to the next update
                status.ClearField(per_step)
        for name, value in fields.items():
            if status.DESCRIPTOR.fields_by_name[name].is_repeated:
                # a repeated field (e.g. edges), given as a list or as another status's container
                # (a stage record's final status restored by FinishedStage): replaced whole
                repeated = getattr(status, name)
                del repeated[:]
                repeated.extend(value)
            else:
                setattr(status, name, value)
        for per_step in PER_STEP:
            if status.HasField(per_step):
                self._last_step[per_step] = getattr(status, per_step)

    def _append_locked(self, status: trainer_pb2.StageStatus) -> None:
        self._history.append(status)
        if len(self._history) > HISTORY_LIMIT:
            del self._history[0]
            self._dropped += 1
        self._condition.notify_all()
        for listener in self._listeners:  # under the lock: every listener sees the history's order
            listener(status)

    def _notify(self) -> None:
        with self._condition:
            waiters, self._waiters = self._waiters, set()
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # that watcher's loop is closed: nobody waits
                loop.call_soon_threadsafe(_wake, future)

    def latest(self) -> trainer_pb2.StageStatus:
        with self._condition:
            return self._history[-1]

    def since(self, version: int, timeout: float) -> tuple[int, list[trainer_pb2.StageStatus]]:
        """Updates after ``version`` (waiting up to ``timeout`` for one), and the new version."""
        with self._condition:
            self._condition.wait_for(lambda: self._version > version, timeout)
            start = max(version - self._dropped, 0)
            return self._version, list(self._history[start:])

    async def wait_since(self, version: int) -> tuple[int, list[trainer_pb2.StageStatus]]:
        """Updates after ``version`` (waiting on the running loop, without a thread, for one)."""
        loop = asyncio.get_running_loop()
        while True:
            with self._condition:
                if self._version > version:
                    start = max(version - self._dropped, 0)
                    return self._version, list(self._history[start:])
                waiter = (loop, loop.create_future())
                self._waiters.add(waiter)
            try:
                await waiter[1]
            finally:
                with self._condition:
                    self._waiters.discard(waiter)

    @property
    def finished(self) -> bool:
        with self._condition:
            return self._history[-1].state in TERMINAL_STATES


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():  # a cancelled watcher's future is already done
        future.set_result(None)
