"""Cutting an encoded tensor into WAN frames and reassembling them, with the framing rules enforced.

Framing is checked apart from content: the assembler only makes sure a header is followed by
its chunks in order and complete; ``decode_tensor`` then checks what they carry.
"""

from __future__ import annotations

from collections.abc import Iterator

from nebula_common.codec.wire_header import MAX_PAYLOAD_BYTES, EncodedTensor, WireFormatError
from nebula_common.proto.nebula.v1 import tensor_pb2

DEFAULT_CHUNK_SIZE = 256 * 1024
"""Chunk size used on the WAN: large enough to amortise per-message cost, small enough to interleave."""


def to_frames(
    encoded: EncodedTensor, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> Iterator[tensor_pb2.TensorFrame]:
    """Yield the header frame, then the payload in ``chunk_size`` chunks, the final one marked ``last``.

    An empty payload still gets one empty chunk with ``last=True`` so the receiver
    always learns that the frame is complete from a chunk.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    header = encoded.header
    yield tensor_pb2.TensorFrame(header=header)
    payload = encoded.payload
    view = memoryview(payload)
    offset = 0
    while True:
        end = min(offset + chunk_size, len(payload))
        last = end >= len(payload)
        yield tensor_pb2.TensorFrame(
            chunk=tensor_pb2.TensorChunk(
                frame_id=header.frame_id, offset=offset, data=bytes(view[offset:end]), last=last
            )
        )
        if last:
            return
        offset = end


class FrameAssembler:
    """Reassemble one stream's frames into ``EncodedTensor``s, enforcing the framing rules.

    A stream carries one frame at a time: a header, then its chunks in order with
    contiguous offsets, the final one marked ``last`` and ending exactly at
    ``payload_size``. The assembler checks framing only; ``decode_tensor`` checks the
    content (codec, sizes, checksum). After an error the partial frame is dropped,
    so the caller may resynchronise on the next header or abort the stream.
    """

    def __init__(self) -> None:
        self._header: tensor_pb2.TensorHeader | None = None
        self._parts: list[bytes] = []
        self._received = 0

    @property
    def in_progress(self) -> bool:
        """True while a header has arrived and its last chunk has not."""
        return self._header is not None

    def reset(self) -> None:
        """Drop any partial frame (e.g. when the stream it came from broke)."""
        self._header = None
        self._parts = []
        self._received = 0

    def feed(self, frame: tensor_pb2.TensorFrame) -> EncodedTensor | None:
        """Consume one frame; return the completed tensor when its last chunk arrives, else None."""
        try:
            return self._feed(frame)
        except WireFormatError:
            self.reset()
            raise

    def _feed(self, frame: tensor_pb2.TensorFrame) -> EncodedTensor | None:
        if not isinstance(frame, tensor_pb2.TensorFrame):
            raise WireFormatError(f"frame: expected a TensorFrame, got {type(frame).__name__}")
        part = frame.WhichOneof("part")
        if part == "header":
            self._start(frame.header)
            return None
        if part == "chunk":
            return self._append(frame.chunk)
        raise WireFormatError("frame: carries neither a header nor a chunk")

    def _start(self, header: tensor_pb2.TensorHeader) -> None:
        if self._header is not None:
            raise WireFormatError(
                f"header: frame {header.frame_id} started while frame {self._header.frame_id} is incomplete "
                f"({self._received} of {self._header.payload_size} bytes received)"
            )
        if header.payload_size > MAX_PAYLOAD_BYTES:
            raise WireFormatError(
                f"payload_size: {header.payload_size} bytes exceeds the {MAX_PAYLOAD_BYTES} allowed"
            )
        self._header = tensor_pb2.TensorHeader()
        self._header.CopyFrom(header)

    def _append(self, chunk: tensor_pb2.TensorChunk) -> EncodedTensor | None:
        header = self._header
        if header is None:
            raise WireFormatError(f"chunk: chunk of frame {chunk.frame_id} arrived without a header")
        if chunk.frame_id != header.frame_id:
            raise WireFormatError(
                f"frame_id: chunk belongs to frame {chunk.frame_id} but frame {header.frame_id} is pending"
            )
        if chunk.offset != self._received:
            raise WireFormatError(
                f"offset: chunk of frame {header.frame_id} starts at {chunk.offset} but {self._received} "
                f"bytes have been received (chunks missing or reordered)"
            )
        end = self._received + len(chunk.data)
        if end > header.payload_size:
            raise WireFormatError(
                f"payload_size: chunks of frame {header.frame_id} carry {end} bytes, more than the "
                f"{header.payload_size} declared"
            )
        if chunk.data:
            self._parts.append(chunk.data)
        self._received = end
        if not chunk.last:
            return None
        if end != header.payload_size:
            raise WireFormatError(
                f"payload_size: last chunk of frame {header.frame_id} ends at {end} bytes but "
                f"{header.payload_size} were declared"
            )
        payload = b"".join(self._parts)
        self.reset()
        return EncodedTensor(header=header, payload=payload)
