"""The trainer's end of one job edge, in tensors and signals: what the pipeline loop talks to.

The edge owns both codec streams of its end (the outgoing direction's encoder, the
incoming direction's decoder), built from the stage spec's codec_forward /
codec_backward. Each tensor is encoded exactly once, when it is queued; replays after
an outage resend those bytes, so stateful codecs (error feedback, delta) advance once
per tensor on both ends. Integer tensors (token ids) travel exactly, as raw bytes with
codec ``none``, whatever the float codec is. Control signals (start barrier, one-way
sync, evaluation done) travel as ``EdgeSignal`` items in the same sequence.

One connection is one epoch of the edge (``EdgeOpen.epoch``). A stage that restarts from
a checkpoint opens a new connection of a higher epoch, so its codec streams start fresh
on both sides (error-feedback residuals and delta caches of the void attempt are gone
at both ends alike, and both restart from the same checkpoint).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nebula_common.codec import EncodedTensor, TensorStreamDecoder, TensorStreamEncoder
from nebula_common.codec.wire_integers import (
    INTEGER_DTYPES,
    decode_integer_tensor,
    encode_integer_tensor,
    is_integer_header,
)
from nebula_common.proto.nebula.v1 import relay_pb2, tensor_pb2
from services.trainer.edge.errors import EdgeClosedError
from services.trainer.edge.session import EdgeSession
from services.trainer.edge.settings import EdgeSettings
from services.trainer.edge.transport import Transport

FORWARD = tensor_pb2.DIRECTION_FORWARD
BACKWARD = tensor_pb2.DIRECTION_BACKWARD
_INTEGER_TYPES = frozenset(INTEGER_DTYPES.values())


@dataclass
class EdgeStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    raw_bytes_sent: int = 0
    raw_bytes_received: int = 0
    frames_sent: int = 0
    frames_received: int = 0
    wait_seconds: float = 0.0
    retransmit_timeout_s: float = 0.0
    """The sending half's current retransmit timeout (measured, with backoff; the cap before any sample)."""
    srtt_s: float | None = None
    """Smoothed round trip send -> ack of our items (None before the first sample)."""
    retransmitted_messages: int = 0


def _signal_name(kind: int) -> str:
    return relay_pb2.SignalKind.Name(kind) if kind in relay_pb2.SignalKind.values() else str(kind)


class EdgeConnection:
    """One edge end: ``send_tensor``/``send_signal`` one direction, ``receive_*`` the other."""

    def __init__(
        self,
        transport: Transport,
        *,
        job_id: str,
        edge: str,
        upstream: bool,
        codec_forward: str = "none",
        codec_backward: str = "none",
        settings: EdgeSettings | None = None,
        epoch: int = 0,
    ) -> None:
        self.job_id = job_id
        self.epoch = epoch
        self.edge = edge
        self.stats = EdgeStats()
        self.send_direction = FORWARD if upstream else BACKWARD
        self.receive_direction = BACKWARD if upstream else FORWARD
        out_spec, in_spec = (codec_forward, codec_backward) if upstream else (codec_backward, codec_forward)
        self._encoder = TensorStreamEncoder(out_spec or "none")
        self._decoder = TensorStreamDecoder(in_spec or "none")
        self.session = EdgeSession(
            transport, self.send_direction, settings, name=edge, epoch=epoch, route=(job_id, edge)
        )
        self.session.start()
        self._refresh_timer_stats()

    def _refresh_timer_stats(self) -> None:
        """Copy the session's retransmit timer into ``stats`` (refreshed on every send and receive)."""
        self.stats.retransmit_timeout_s = self.session.retransmit_timeout()
        self.stats.srtt_s = self.session.rtt_estimate()[0]
        self.stats.retransmitted_messages = self.session.retransmitted_messages

    @property
    def settings(self) -> EdgeSettings:
        return self.session.settings

    # ------------------------------------------------------------------ sending

    def send_tensor(
        self,
        tensor: torch.Tensor,
        step: int,
        micro_batch: int,
        sample_ids: Sequence[int] | None = None,
    ) -> tensor_pb2.TensorHeader:
        """Encode (once) and queue a tensor; returns once it is queued (not delivered)."""
        fields = dict(
            job_id=self.job_id, edge=self.edge, direction=self.send_direction, micro_batch=micro_batch
        )

        # ``borrow``: a codec-``none`` payload is a view of ``tensor``, not a copy; the session frames
        # (copies) all of it before enqueue_tensor returns, so the caller may change the tensor after.
        def build(frame_id: int) -> EncodedTensor:
            if tensor.dtype in _INTEGER_TYPES:
                return encode_integer_tensor(
                    tensor.detach(), borrow=True, step=step, frame_id=frame_id, **fields
                )
            return self._encoder.encode(
                tensor, step=step, sample_ids=sample_ids, frame_id=frame_id, borrow=True, **fields
            )

        encoded = self.session.enqueue_tensor(build)
        self.stats.bytes_sent += encoded.header.payload_size
        self.stats.raw_bytes_sent += encoded.header.raw_size
        self.stats.frames_sent += 1
        self._refresh_timer_stats()
        return encoded.header

    def send_signal(self, kind: int, step: int = 0, values: Sequence[float] = ()) -> None:
        """Queue a control signal (exact values, no codec) in sequence with the tensors."""
        self.session.enqueue_signal(kind, step, values)

    # ------------------------------------------------------------------ receiving

    def _next(self, timeout: float, what: str) -> EncodedTensor | relay_pb2.EdgeSignal:
        started = time.perf_counter()
        try:
            return self.session.receive_item(timeout, what)
        finally:
            self.stats.wait_seconds += time.perf_counter() - started
            self._refresh_timer_stats()

    def receive_tensor(
        self,
        step: int,
        micro_batch: int,
        sample_ids: Sequence[int] | None = None,
        timeout: float = 300.0,
    ) -> torch.Tensor:
        """Block until the next item arrives; it must be the tensor the schedule expects."""
        item = self._next(timeout, f"tensor for step {step} micro-batch {micro_batch}")
        if not isinstance(item, EncodedTensor):
            raise EdgeClosedError(
                f"schedule mismatch: expected the tensor of step {step} micro-batch {micro_batch}, "
                f"got signal {_signal_name(item.kind)} of step {item.step}"
            )
        header = item.header
        if (header.step, header.micro_batch) != (step, micro_batch):
            raise EdgeClosedError(
                f"schedule mismatch: expected direction {self.receive_direction} step {step} micro-batch "
                f"{micro_batch}, got direction {header.direction} step {header.step} micro-batch "
                f"{header.micro_batch}"
            )
        self.stats.bytes_received += header.payload_size
        self.stats.raw_bytes_received += header.raw_size
        self.stats.frames_received += 1
        if is_integer_header(header):
            return decode_integer_tensor(header, item.payload)
        return self._decoder.decode(header, item.payload, sample_ids=sample_ids)

    def receive_signal(self, kind: int, step: int = 0, timeout: float = 300.0) -> list[float]:
        """Block until the next item arrives; it must be signal ``kind`` of ``step``. Returns its values."""
        what = f"{_signal_name(kind)} signal for step {step}"
        item = self._next(timeout, what)
        if not isinstance(item, relay_pb2.EdgeSignal):
            header = item.header
            raise EdgeClosedError(
                f"schedule mismatch: expected {what}, got the tensor of step {header.step} "
                f"micro-batch {header.micro_batch}"
            )
        if (item.kind, item.step) != (kind, step):
            raise EdgeClosedError(
                f"schedule mismatch: expected {what}, got {_signal_name(item.kind)} for step {item.step}"
            )
        return list(item.values)

    # ------------------------------------------------------------------ ending

    def close(self, reason: str = "finished", timeout: float = 30.0) -> None:
        """Deliver what is queued, close our side and wait (bounded) for the peer to close too."""
        self.session.close(reason, timeout)

    def abort(self, reason: str) -> None:
        """Tell the peer (best effort) and tear the edge down now; safe from any thread, repeatable."""
        self.session.fail(reason)


__all__ = ["BACKWARD", "FORWARD", "EdgeConnection", "EdgeStats"]
