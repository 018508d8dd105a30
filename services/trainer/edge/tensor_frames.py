"""The messages an item travels as on an edge, and the buffer a tensor is reassembled in.

A tensor is a header, then its payload's chunks. When the session knows its route (job, edge) and
its transport carries framed chunks (``transport.frames_chunks``: the gRPC stream to the switch),
each payload chunk is built once as its final wire bytes (``nebula_common/rpc/framing.py``) in
chunks of the window / 8 (256 KiB .. 4 MiB), and replays resend those bytes; chunks from the peer
arrive as ``FramedChunk`` views and are copied once, into the frame's buffer (``FrameAssembly``),
which becomes the payload without another copy. Other transports (the in-memory pair of the tests)
carry payload chunks as ``TensorFrame`` messages.

Credit counts the contract's wire size of each message (``wire_size``), whichever way it travels.
"""

from __future__ import annotations

from dataclasses import dataclass

from nebula_common.codec import EncodedTensor, to_frames
from nebula_common.proto.nebula.v1 import relay_pb2, tensor_pb2
from nebula_common.rpc.framing import chunk_size_for, encode_chunk

OutgoingMessage = tuple[relay_pb2.EdgeMessage | bytes, int]
"""A message to transmit (``bytes``: a framed chunk, sent as is) and its wire size."""


def wire_size(message: relay_pb2.EdgeMessage) -> int:
    """The contract's wire size of an item's message: ByteSize() of its TensorFrame or EdgeSignal."""
    kind = message.WhichOneof("body")
    if kind == "frame":
        return message.frame.ByteSize()
    if kind == "signal":
        return message.signal.ByteSize()
    raise ValueError(f"{kind!r} is not a sequenced item")


def frame_messages(
    encoded: EncodedTensor, route: tuple[str, str] | None, epoch: int, window: int
) -> list[OutgoingMessage]:
    """The header, then the payload's chunks: framed once for ``route`` (job id, edge) of ``epoch``,
    in chunks sized for ``window``, or as ``TensorFrame`` messages when ``route`` is None."""
    if route is None:
        frames = [relay_pb2.EdgeMessage(frame=f) for f in to_frames(encoded)]
        return [(m, wire_size(m)) for m in frames]
    header = relay_pb2.EdgeMessage(frame=tensor_pb2.TensorFrame(header=encoded.header))
    messages: list[OutgoingMessage] = [(header, wire_size(header))]
    job_id, edge = route
    frame_id = encoded.header.frame_id
    payload = memoryview(encoded.payload)
    size = len(payload)
    step = chunk_size_for(window)
    offset = 0
    while True:
        end = min(offset + step, size)
        last = end >= size
        raw, frame_size = encode_chunk(job_id, edge, epoch, frame_id, offset, payload[offset:end], last)
        messages.append((raw, frame_size))
        if last:
            return messages
        offset = end


@dataclass
class FrameAssembly:
    """The tensor being received: its header and the payload buffer its chunks are copied into."""

    header: tensor_pb2.TensorHeader
    payload: bytearray
    received: int = 0


__all__ = ["FrameAssembly", "OutgoingMessage", "frame_messages", "wire_size"]
