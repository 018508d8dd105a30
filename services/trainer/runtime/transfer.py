"""Async sends with a bounded in-flight queue: compute overlaps encoding and the WAN, with back-pressure.

A send hands the tensor (or signal) to a sender thread and returns at once; if
``max_in_flight`` items are already waiting to be encoded and queued, the caller
blocks (that time counts as waiting for the other cluster). Items are handed to the
edge in order by one thread, so the edge's codec stream sees its tensors in schedule
order, as stateful codecs require, and signals keep their place among them.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.trainer.edge import EdgeClosedError, EdgeConnection, renewed


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
    def __init__(self, edge: EdgeConnection, max_in_flight: int) -> None:
        self.edge = edge
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
        self.blocked_seconds += time.perf_counter() - started

    def send(self, tensor: torch.Tensor, step: int, micro_batch: int, sample_ids: Sequence[int]) -> None:
        self._put(_Send(tensor.detach(), step, micro_batch, list(sample_ids)))

    def send_signal(self, kind: int, step: int, values: Sequence[float] = ()) -> None:
        self._put(_Signal(kind, step, [float(v) for v in values]))

    def flush(self) -> None:
        """Wait until every queued item is encoded and handed to the edge."""
        started = time.perf_counter()
        self._queue.join()
        self.blocked_seconds += time.perf_counter() - started
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
