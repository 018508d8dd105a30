"""Per-(job, edge, direction, step) summaries of what crossed the WAN, for the audit log.

Derived from the RoutedItem frames on the link: headers only (job, step, codec, payload and raw
sizes) and chunk lengths: the switch never decodes a tensor to account for it. A step's summary is
written when a later step's first frame appears on the same (job, edge, direction), when the edge
closes, or when the link ends, so each step yields exactly one record per direction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from nebula_common.proto.nebula.v1 import link_pb2
from nebula_common.rpc.framing import FramedChunk

TransferKey = tuple[str, str, str]  # (job_id, edge, direction)


@dataclass
class StepTotals:
    step: int
    frames: int = 0
    payload_bytes: int = 0
    raw_bytes: int = 0
    wire_bytes: int = 0
    codecs: set[str] = field(default_factory=set)


Emit = Callable[[TransferKey, StepTotals], None]


class TransferLedger:
    """Accumulates one step per (job, edge, direction) and emits it when the step is over."""

    def __init__(self, emit: Emit) -> None:
        self._emit = emit
        self._open: dict[TransferKey, StepTotals] = {}
        # Chunks name only a frame id: remember which (job, edge, direction) each frame belongs to.
        self._frames: dict[tuple[str, str, int], TransferKey] = {}

    def observe(self, direction: str, message: link_pb2.LinkMessage) -> None:
        if message.WhichOneof("body") != "routed":
            return
        routed = message.routed
        kind = routed.item.WhichOneof("body")
        if kind == "close":
            self.flush_edge(routed.job_id, routed.edge)
            return
        if kind != "frame":
            return
        part = routed.item.frame
        if part.HasField("header"):
            header = part.header
            key = (routed.job_id, routed.edge, direction)
            totals = self._open.get(key)
            if totals is not None and totals.step != header.step:
                self._emit(key, self._open.pop(key))
                totals = None
            if totals is None:
                totals = self._open[key] = StepTotals(step=int(header.step))
            totals.frames += 1
            totals.raw_bytes += header.raw_size
            totals.codecs.add(header.codec or "none")
            totals.wire_bytes += message.ByteSize()
            self._frames[(routed.job_id, routed.edge, header.frame_id)] = key
        elif part.HasField("chunk"):
            chunk = part.chunk
            frame_key = (routed.job_id, routed.edge, chunk.frame_id)
            key = self._frames.get(frame_key)
            if key is None or key not in self._open:
                return
            totals = self._open[key]
            totals.payload_bytes += len(chunk.data)
            totals.wire_bytes += message.ByteSize()
            if chunk.last:
                self._frames.pop(frame_key, None)

    def observe_chunk(self, direction: str, chunk: FramedChunk) -> None:
        """A framed chunk counts toward its frame's step totals as a ``TensorChunk`` item does."""
        frame_key = (chunk.job_id, chunk.edge, chunk.frame_id)
        key = self._frames.get(frame_key)
        if key is None or key not in self._open:
            return
        totals = self._open[key]
        totals.payload_bytes += len(chunk.data)
        totals.wire_bytes += len(chunk.raw)
        if chunk.last:
            self._frames.pop(frame_key, None)

    def flush_edge(self, job_id: str, edge: str) -> None:
        for key in [k for k in self._open if k[0] == job_id and k[1] == edge]:
            self._emit(key, self._open.pop(key))
        for frame_key in [f for f in self._frames if f[0] == job_id and f[1] == edge]:
            del self._frames[frame_key]

    def flush_all(self) -> None:
        for key in list(self._open):
            self._emit(key, self._open.pop(key))
        self._frames.clear()
