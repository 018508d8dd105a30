"""The trainer's end of one job edge: a Relay.OpenEdge stream to the local switch.

Training code is synchronous torch, so this is a sync gRPC stream: outgoing
messages go through a bounded queue that gRPC drains on its own thread (a send
returns as soon as the frames are queued, which lets compute overlap the WAN
transfer), and a receiver thread reassembles incoming frames into tensors.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc
import torch

from nebula_common.codec import (
    EncodedTensor,
    FrameAssembler,
    TensorStreamDecoder,
    TensorStreamEncoder,
    to_frames,
)
from nebula_common.proto.nebula.v1 import relay_pb2, relay_pb2_grpc, tensor_pb2
from nebula_common.rpc import bearer_metadata, insecure_channel

log = logging.getLogger(__name__)
_CLOSED = object()


class EdgeClosedError(RuntimeError):
    """The edge ended (peer finished, failed, or the link dropped) while we expected a tensor."""


@dataclass
class EdgeStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    raw_bytes_sent: int = 0
    raw_bytes_received: int = 0
    wait_seconds: float = 0.0


class EdgeConnection:
    def __init__(
        self,
        switch_address: str,
        token: str,
        job_id: str,
        edge: str,
        *,
        send_queue_frames: int = 64,
        receive_queue_tensors: int = 0,
        ready_timeout: float = 90.0,
    ) -> None:
        self.job_id = job_id
        self.edge = edge
        self.stats = EdgeStats()
        self._frame_ids = itertools.count(1)
        self._outgoing: queue.Queue[object] = queue.Queue(maxsize=send_queue_frames)
        # Bounded (receive_queue_tensors > 0): a receiver that falls behind stops reading the stream,
        # and gRPC flow control carries the back-pressure through the switches to the sender.
        self._incoming: queue.Queue[object] = queue.Queue(maxsize=receive_queue_tensors)
        self._torn_down = threading.Event()
        self._channel = insecure_channel(switch_address)
        stub = relay_pb2_grpc.RelayStub(self._channel)
        self._outgoing.put(relay_pb2.EdgeMessage(open=relay_pb2.EdgeOpen(job_id=job_id, edge=edge)))
        self._call = stub.OpenEdge(self._requests(), metadata=bearer_metadata(token))
        self._ready = threading.Event()
        self._close_reason: str | None = None
        self._receiver = threading.Thread(target=self._receive, name=f"edge-recv-{edge}", daemon=True)
        self._receiver.start()
        if not self._ready.wait(ready_timeout):
            self.abort("edge not ready in time")
            raise EdgeClosedError(f"switch did not open edge {edge!r} within {ready_timeout:.0f}s")
        if self._close_reason is not None:
            raise EdgeClosedError(self._close_reason)

    def _requests(self) -> Iterator[relay_pb2.EdgeMessage]:
        while True:
            item = self._outgoing.get()
            if item is _CLOSED:
                return
            yield item

    def _receive(self) -> None:
        assembler = FrameAssembler()
        try:
            for message in self._call:
                kind = message.WhichOneof("body")
                if kind == "ready":
                    self._ready.set()
                elif kind == "frame":
                    encoded = assembler.feed(message.frame)
                    if encoded is not None and not self._deliver(encoded):
                        break
                elif kind == "close":
                    self._close_reason = message.close.reason or "peer closed the edge"
                    if message.close.error:
                        self._close_reason = f"peer side failed: {self._close_reason}"
                    break
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self._close_reason = f"switch stream failed: {exc.code().name}: {exc.details()}"
        except Exception as exc:  # a malformed frame must end the edge, not hang the trainer
            self._close_reason = f"invalid frame from peer: {exc}"
        finally:
            if self._close_reason is None:
                self._close_reason = "edge stream ended"
            self._ready.set()
            self._put_closed()

    def _put_closed(self) -> None:
        """Wake any receive() for good, even on a full queue after teardown (its tensors are moot then)."""
        while True:
            try:
                self._incoming.put_nowait(_CLOSED)
                return
            except queue.Full:
                with contextlib.suppress(queue.Empty):
                    self._incoming.get_nowait()

    def _deliver(self, item: object) -> bool:
        """Queue an incoming item, waiting while the queue is full; False once the edge is torn down."""
        while not self._torn_down.is_set():
            try:
                self._incoming.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def send(
        self,
        tensor: torch.Tensor,
        encoder: TensorStreamEncoder,
        direction: int,
        step: int,
        micro_batch: int,
        sample_ids: Sequence[int] | None = None,
    ) -> tensor_pb2.TensorHeader:
        """Encode and queue a tensor; returns once its frames are queued (not delivered)."""
        if self._close_reason is not None:
            raise EdgeClosedError(self._close_reason)
        encoded = encoder.encode(
            tensor,
            step=step,
            sample_ids=sample_ids,
            job_id=self.job_id,
            edge=self.edge,
            direction=direction,
            micro_batch=micro_batch,
            frame_id=next(self._frame_ids),
        )
        for frame in to_frames(encoded):
            self._outgoing.put(relay_pb2.EdgeMessage(frame=frame))
        self.stats.bytes_sent += encoded.header.payload_size
        self.stats.raw_bytes_sent += encoded.header.raw_size
        return encoded.header

    def receive(
        self,
        decoder: TensorStreamDecoder,
        direction: int,
        step: int,
        micro_batch: int,
        sample_ids: Sequence[int] | None = None,
        timeout: float = 300.0,
    ) -> torch.Tensor:
        """Block until the next tensor arrives; it must be the one the schedule expects."""
        started = time.perf_counter()
        try:
            item = self._incoming.get(timeout=timeout)
        except queue.Empty:
            raise EdgeClosedError(
                f"no tensor for step {step} micro-batch {micro_batch} in {timeout:.0f}s"
            ) from None
        finally:
            self.stats.wait_seconds += time.perf_counter() - started
        if item is _CLOSED:
            self._put_closed()
            raise EdgeClosedError(self._close_reason or "edge closed")
        if not isinstance(item, EncodedTensor):
            raise EdgeClosedError("internal error: unexpected item on the edge queue")
        header = item.header
        if (header.direction, header.step, header.micro_batch) != (direction, step, micro_batch):
            raise EdgeClosedError(
                f"schedule mismatch: expected direction {direction} step {step} micro-batch {micro_batch}, "
                f"got direction {header.direction} step {header.step} micro-batch {header.micro_batch}"
            )
        self.stats.bytes_received += header.payload_size
        self.stats.raw_bytes_received += header.raw_size
        return decoder.decode(header, item.payload, sample_ids=sample_ids)

    def close(self, reason: str = "finished", error: bool = False, timeout: float = 30.0) -> None:
        """Close our side and wait (bounded) for the peer to close its side too."""
        close = relay_pb2.EdgeMessage(close=relay_pb2.EdgeClose(reason=reason, error=error))
        self._outgoing.put(close)
        self._outgoing.put(_CLOSED)
        self._receiver.join(timeout)
        self._torn_down.set()
        self._call.cancel()
        self._channel.close()

    def abort(self, reason: str) -> None:
        """Tell the peer (best effort) and tear the stream down now; safe from any thread, repeatable."""
        for item in (relay_pb2.EdgeMessage(close=relay_pb2.EdgeClose(reason=reason, error=True)), _CLOSED):
            try:
                self._outgoing.put_nowait(item)
            except queue.Full:
                break
        if self._close_reason is None:
            self._close_reason = reason
        self._torn_down.set()
        self._call.cancel()
        self._channel.close()
