"""Transfers off the stage thread: compute overlaps encoding, decoding and the WAN, both ways.

``AsyncSender``: a send hands the tensor (or signal) to a sender thread and returns at once; if
``max_in_flight`` items are already waiting to be encoded and queued, the caller
blocks (that time counts as waiting for the other cluster). Items are handed to the
edge in order by one thread, so the edge's codec stream sees its tensors in schedule
order, as stateful codecs require, and signals keep their place among them.

``ReceiveAhead``: the stage posts what its schedule will receive next (``expect_tensor``,
``expect_signal``, in order) and later takes it (``tensor``, ``signal``). One receive thread
reads and *decodes* the posted items as soon as they arrive, up to ``depth`` decoded items
ahead of the stage, so the next micro-batch is a ready tensor when the stage's compute of
the current one ends, and the decoder stream (stateful codecs) still sees its items in
order on one thread. ``depth=0`` is the serial path: the stage thread receives and decodes
itself when it takes an item (kept as the reference the overlapped path must reproduce bit
for bit, and for measuring what the overlap gains).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.trainer.edge import EdgeClosedError, EdgeConnection, renewed
from services.trainer.runtime.timers import StepTimer


@dataclass
class _Send:
    tensor: torch.Tensor
    step: int
    micro_batch: int
    sample_ids: list[int]


@dataclass
class _Signal:
    kind: int
    step: int
    values: list[float]


_STOP = object()


class AsyncSender:
    def __init__(self, edge: EdgeConnection, max_in_flight: int, timer: StepTimer | None = None) -> None:
        self.edge = edge
        self.timer = timer or StepTimer()
        self.blocked_seconds = 0.0
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_in_flight)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name=f"send-{edge.edge}", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                if self._error is not None:
                    continue
                with self.timer.timing("send"):
                    if isinstance(item, _Send):
                        self.edge.send_tensor(item.tensor, item.step, item.micro_batch, item.sample_ids)
                    elif isinstance(item, _Signal):
                        self.edge.send_signal(item.kind, item.step, item.values)
            except BaseException as exc:
                self._error = exc
            finally:
                self._queue.task_done()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            if isinstance(self._error, EdgeClosedError):
                raise renewed(self._error)
            raise EdgeClosedError(f"send failed: {type(self._error).__name__}: {self._error}")

    def _put(self, item: object) -> None:
        self._raise_if_failed()
        started = time.perf_counter()
        self._queue.put(item)
        self._blocked(time.perf_counter() - started)

    def _blocked(self, seconds: float) -> None:
        self.blocked_seconds += seconds
        self.timer.add("wait", seconds)

    def send(self, tensor: torch.Tensor, step: int, micro_batch: int, sample_ids: Sequence[int]) -> None:
        self._put(_Send(tensor.detach(), step, micro_batch, list(sample_ids)))

    def send_signal(self, kind: int, step: int, values: Sequence[float] = ()) -> None:
        self._put(_Signal(kind, step, [float(v) for v in values]))

    def flush(self) -> None:
        """Wait until every queued item is encoded and handed to the edge."""
        started = time.perf_counter()
        self._queue.join()
        self._blocked(time.perf_counter() - started)
        self._raise_if_failed()

    def stop(self, discard: bool = False) -> None:
        """End the sender thread; ``discard`` skips what is still queued (the edge is already gone).

        A stage that fails or is cancelled never reaches its orderly ``stop()``; without this the
        thread would wait on its queue forever, holding the edge and its retransmit buffer.
        """
        if not self._thread.is_alive():
            return
        if discard and self._error is None:
            self._error = EdgeClosedError("stage ended")
        try:
            self._queue.put(_STOP, timeout=5)
        except queue.Full:
            return
        self._thread.join(5)


@dataclass(frozen=True)
class _ExpectTensor:
    step: int
    micro_batch: int
    sample_ids: tuple[int, ...]
    timeout: float

    def describe(self) -> str:
        return f"the tensor of step {self.step} micro-batch {self.micro_batch}"


@dataclass(frozen=True)
class _ExpectSignal:
    kind: int
    step: int
    timeout: float

    def describe(self) -> str:
        return f"signal {self.kind} of step {self.step}"


@dataclass(frozen=True)
class _Failed:
    error: BaseException


_Expected = _ExpectTensor | _ExpectSignal
RECEIVE_TIMEOUT_S = 300.0
"""How long one item may take to arrive (link-up time, as ``EdgeConnection.receive_*``)."""
_POLL_S = 0.25
"""How often a blocked receive thread or stage re-checks for a stop or a dead thread."""


class ReceiveAhead:
    """The stage's incoming items, received and decoded on a thread of their own (see the module doc).

    Errors of the edge (outage, restart required, peer error, cancel) reach the stage from the
    ``tensor``/``signal`` call that would have received the item, as the same exception type, so
    the stage's recovery handles them as before. ``stop()`` ends the thread; after a failure or a
    cancel the stage's edge is aborted first, which ends a receive in progress at once.
    """

    def __init__(
        self,
        edge: EdgeConnection,
        depth: int,
        timer: StepTimer | None = None,
        *,
        track_arrivals: bool = False,
    ) -> None:
        if depth < 0:
            raise ValueError(f"receive-ahead depth must be >= 0, got {depth}")
        self.edge = edge
        self.depth = depth
        self.timer = timer or StepTimer()
        self.blocked_seconds = 0.0
        self.track_arrivals = track_arrivals
        """Keep each tensor's ready time for ``arrivals`` (a 1F1B upstream sizes its window from them)."""
        self._expected: deque[_Expected] = deque()  # posted, not yet taken by the stage
        self._plan: queue.Queue[object] = queue.Queue()  # posted, not yet received by the thread
        self._results: queue.Queue[object] = queue.Queue(maxsize=max(depth, 1))
        self._stopping = threading.Event()
        # Why the thread ended, kept apart from the results: a stop() racing the failure may keep it
        # out of the queue, and the stage must still learn the real reason, not "thread ended".
        self._failure: BaseException | None = None
        self._arrived: dict[tuple[int, int], float] = {}  # (step, micro-batch) -> decoded and ready
        self._arrived_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if depth > 0:
            self._thread = threading.Thread(target=self._drain, name=f"receive-{edge.edge}", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ stage side

    def expect_tensor(
        self, step: int, micro_batch: int, sample_ids: Sequence[int], timeout: float = RECEIVE_TIMEOUT_S
    ) -> None:
        """Post the next tensor the schedule will take; the thread receives and decodes it when it comes."""
        self._post(_ExpectTensor(step, micro_batch, tuple(sample_ids), timeout))

    def expect_signal(self, kind: int, step: int, timeout: float = RECEIVE_TIMEOUT_S) -> None:
        self._post(_ExpectSignal(kind, step, timeout))

    def _post(self, expected: _Expected) -> None:
        self._expected.append(expected)
        if self._thread is not None:
            self._plan.put(expected)

    def arrivals(self, step: int) -> dict[int, float]:
        """When each tensor of ``step`` the receive thread got was decoded and ready
        (``time.perf_counter()``), by micro-batch; taken once (forgotten after this call).
        Empty on the serial path (depth 0), where arrival is not seen apart from the take."""
        with self._arrived_lock:
            taken = {mb: at for (s, mb), at in self._arrived.items() if s == step}
            for mb in taken:
                del self._arrived[(step, mb)]
            self._arrived = {key: at for key, at in self._arrived.items() if key[0] > step}
        return taken

    @property
    def pending(self) -> int:
        """Items posted and not yet taken by the stage."""
        return len(self._expected)

    def tensor(self, step: int, micro_batch: int) -> torch.Tensor:
        """The posted tensor of (step, micro_batch), decoded; blocks (counted as wait) until it is."""
        result = self._take(_ExpectTensor(step, micro_batch, (), 0.0))
        if not isinstance(result, torch.Tensor):
            raise TypeError(f"expected a tensor for step {step} micro-batch {micro_batch}, got {result!r}")
        return result

    def signal(self, kind: int, step: int) -> list[float]:
        """The posted signal ``kind`` of ``step``'s values; blocks (counted as wait) until it arrives."""
        result = self._take(_ExpectSignal(kind, step, 0.0))
        if not isinstance(result, list):
            raise TypeError(f"expected signal {kind} of step {step}, got a tensor")
        return result

    def _take(self, wanted: _Expected) -> object:
        """The next posted item's result; it must be ``wanted`` (the stage takes in the order it posts)."""
        if not self._expected:
            raise RuntimeError(f"{wanted.describe()} was taken but never posted (expect_* first)")
        expected = self._expected[0]
        if expected.describe() != wanted.describe():
            raise RuntimeError(f"took {wanted.describe()} but the next posted item is {expected.describe()}")
        self._expected.popleft()
        started = time.perf_counter()
        try:
            if self._thread is None:
                return self._receive(expected)  # serial: this thread waits and decodes
            return self._next_result()
        finally:
            if self._thread is not None:
                self._blocked(time.perf_counter() - started)

    def _next_result(self) -> object:
        thread = self._thread
        if thread is None:
            raise RuntimeError("no receive thread (depth 0 receives on the stage thread)")
        while True:
            try:
                result = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                if not thread.is_alive() and self._results.empty():
                    if self._failure is not None:
                        raise _closed(self._failure) from None
                    raise EdgeClosedError("the receive thread has ended") from None
                continue
            if isinstance(result, _Failed):
                raise _closed(result.error)
            return result

    def _blocked(self, seconds: float) -> None:
        self.blocked_seconds += seconds
        self.timer.add("wait", seconds)

    # ------------------------------------------------------------------ receiving (either thread)

    def _receive(self, expected: _Expected) -> torch.Tensor | list[float]:
        """Receive and decode one item; split its time into waiting for the wire and decoding."""
        stats = self.edge.stats
        started, waited_before = time.perf_counter(), stats.wait_seconds
        try:
            if isinstance(expected, _ExpectTensor):
                return self.edge.receive_tensor(
                    expected.step, expected.micro_batch, list(expected.sample_ids), timeout=expected.timeout
                )
            return self.edge.receive_signal(expected.kind, expected.step, timeout=expected.timeout)
        finally:
            waited = stats.wait_seconds - waited_before
            busy = max(time.perf_counter() - started - waited, 0.0)
            if self._thread is None:
                self._blocked(waited)
                self.timer.add("decode", busy)
            else:
                self.timer.add("receive_wait", waited)
                self.timer.add("decode", busy)

    def _drain(self) -> None:
        while not self._stopping.is_set():
            try:
                expected = self._plan.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if expected is _STOP:
                return
            try:
                result: object = self._receive(expected)  # type: ignore[arg-type]
            except BaseException as exc:
                self._failure = exc
                self._deliver(_Failed(exc))
                return  # nothing after a failed item can be trusted to be in order
            if self.track_arrivals and isinstance(expected, _ExpectTensor):
                with self._arrived_lock:
                    self._arrived[(expected.step, expected.micro_batch)] = time.perf_counter()
            if not self._deliver(result):
                return

    def _deliver(self, result: object) -> bool:
        """Hand a result to the stage, waiting while ``depth`` are already waiting; False once stopping."""
        while not self._stopping.is_set():
            try:
                self._results.put(result, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def stop(self, timeout: float = 5.0) -> None:
        """End the receive thread (idempotent). Items posted and not received are dropped.

        A receive in progress ends when the edge is aborted (the stage's lifecycle does that on
        any failure or cancel before its cleanup runs), or at its timeout.
        """
        self._stopping.set()
        if self._thread is None:
            return
        self._plan.put(_STOP)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


def _closed(error: BaseException) -> EdgeClosedError:
    """The error a failed receive hands the stage: the edge's own close, or one naming the failure."""
    if isinstance(error, EdgeClosedError):
        return renewed(error)
    return EdgeClosedError(f"receive failed: {type(error).__name__}: {error}")
