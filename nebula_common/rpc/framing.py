"""Framed chunks: a tensor chunk built once, as the exact bytes every hop of the data path carries.

Link framing is the payload format of every hop: every trainer and switch speaks it and announces
``LINK_FRAMING_VERSION`` (``EdgeOpen.link_framing``, ``EdgeReady.link_framing``, ``Handshake.link_framing``);
an open, ready or handshake announcing anything else is refused (``framing_refusal``). A payload chunk of edge
protocol 2 is ``RoutedItem{job_id, edge, epoch, item: EdgeMessage{frame: TensorFrame{chunk}}}``. Field 9
of both ``EdgeMessage`` and ``LinkMessage`` is such a ``RoutedItem`` (``framed``), so ONE byte string
is at once a valid ``EdgeMessage`` (trainer -> switch, switch -> trainer) and a valid ``LinkMessage``
(switch -> switch). The sending trainer builds it once; both switches forward it untouched with raw-bytes
(identity) gRPC serializers, reading only the small header in front of the payload; the receiving
trainer copies the payload out of a view of it into the tensor's buffer. Nothing re-encodes the
payload on the way, and no hop runs protobuf over it.

The bytes are ordinary protobuf (any parser reads them), written by hand so the payload is joined once
with its headers instead of being copied by ``bytes(...)``, by the message constructor and again by
``SerializeToString``. Fields are written in this order (protobuf allows any order) so the payload is
last and the parser never scans it::

    0x4a len  RoutedItem:  0x0a job_id  0x12 edge  0x20 epoch  0x1a len  EdgeMessage:
        0x12 len  TensorFrame:  0x12 len  TensorChunk:  0x08 frame_id  0x10 offset  0x20 last  0x1a data

Zero-valued scalars and empty strings are omitted, as proto3 serializers do, so ``frame_size`` equals
``TensorFrame.ByteSize()`` of the same chunk: the wire size credit is counted in (relay.proto).
"""

from __future__ import annotations

from dataclasses import dataclass

FRAMED_FIELD = 9
"""Field number of ``framed`` in both EdgeMessage and LinkMessage."""
FRAMED_TAG = (FRAMED_FIELD << 3) | 2
_MAX_FIELD_NUMBER = 1 << 29
"""Field numbers are below this and above 0 (protobuf's own bounds): other keys are corruption."""
LINK_FRAMING_VERSION = 1
"""The ``link_framing`` every open, ready and handshake carries; any other value is refused."""

MIN_CHUNK_BYTES = 256 << 10
MAX_CHUNK_BYTES = 4 << 20
"""Bounds of the chunk size (the internal gRPC limit is 64 MiB; 4 MiB keeps one chunk well under it)."""


class FramingError(ValueError):
    """Bytes that claim to be a framed chunk but are not one (truncated, wrong fields)."""


def framing_refusal(field: str, announced: int) -> str | None:
    """Why an open, ready or handshake whose ``field`` announced ``announced`` is refused (None: accepted).

    Framed chunks are the only payload format on every hop, so a peer announcing another value could
    neither read what it is sent nor be read; refusing it at once names the mismatch instead of failing
    on the first chunk.
    """
    if announced == LINK_FRAMING_VERSION:
        return None
    return f"{field} {announced} is not supported: it must be {LINK_FRAMING_VERSION} (framed payload chunks)"


def chunk_size_for(window_bytes: int) -> int:
    """Chunk size from the credit window: window / 8, clamped to [256 KiB, 4 MiB].

    Eight chunks per window keep the sender transmitting while acks of the first chunks travel back;
    bigger chunks cost fewer per-chunk steps (Python work on four processes); smaller ones let a
    big tensor of one job interleave with other jobs' items at each switch.
    """
    return max(MIN_CHUNK_BYTES, min(MAX_CHUNK_BYTES, window_bytes // 8))


def _varint(value: int) -> bytes:
    if value < 0:
        raise FramingError(f"negative value {value} cannot be a varint here")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(tag: int, body: bytes) -> bytes:
    return bytes((tag,)) + _varint(len(body)) + body


def _read_varint(view: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end:
            raise FramingError("framed chunk truncated inside a varint")
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if value >> 64:  # a 10th byte above 1: protobuf would keep the low 64 bits, a different number
                raise FramingError("framed chunk has a varint above 64 bits")
            return value, pos
        shift += 7
        if shift > 63:
            raise FramingError("framed chunk has a varint longer than 10 bytes")


def _fields(view: memoryview, pos: int, end: int) -> dict[int, int | tuple[int, int]]:
    """Fields of one message between ``pos`` and ``end``: varints as ints, bytes as (start, stop)."""
    found: dict[int, int | tuple[int, int]] = {}
    while pos < end:
        key, pos = _read_varint(view, pos, end)
        number, wire = key >> 3, key & 7
        if not 0 < number < _MAX_FIELD_NUMBER:
            raise FramingError(f"framed chunk has field number {number}, which protobuf does not allow")
        if number in found:  # protobuf merges a repeated message field, this reader would keep the last
            raise FramingError(f"framed chunk repeats field {number}")
        if wire == 0:
            value, pos = _read_varint(view, pos, end)
            found[number] = value
        elif wire == 2:
            length, pos = _read_varint(view, pos, end)
            if pos + length > end:
                raise FramingError(f"framed chunk truncated: field {number} needs {length} bytes")
            found[number] = (pos, pos + length)
            pos += length
        else:
            raise FramingError(f"framed chunk has field {number} of unexpected wire type {wire}")
    return found


def _span(found: dict[int, int | tuple[int, int]], number: int, what: str) -> tuple[int, int]:
    value = found.get(number)
    if not isinstance(value, tuple):
        raise FramingError(f"framed chunk has no {what}")
    return value


def _text(view: memoryview, found: dict[int, int | tuple[int, int]], number: int, what: str) -> str:
    """A string field as protobuf reads it: UTF-8, or a FramingError (never a bare UnicodeDecodeError,
    which the hops catching FramingError would let through)."""
    try:
        return bytes(view[slice(*_span(found, number, what))]).decode()
    except UnicodeDecodeError as exc:
        raise FramingError(f"framed chunk {what} is not UTF-8: {exc}") from None


def _int(found: dict[int, int | tuple[int, int]], number: int) -> int:
    value = found.get(number, 0)
    if isinstance(value, tuple):
        raise FramingError(f"framed chunk field {number} should be a number")
    return value


@dataclass(frozen=True)
class FramedChunk:
    """A parsed framed chunk: routing tag, chunk fields and a view of the payload (not a copy).

    ``raw`` is the whole framed message, forwarded as is; ``data`` is a memoryview into it.
    """

    raw: bytes
    job_id: str
    edge: str
    epoch: int
    frame_id: int
    offset: int
    last: bool
    data: memoryview
    frame_size: int
    """``TensorFrame.ByteSize()`` of this chunk: its wire size for credit."""
    placed: object = None
    """Set when the receiver read the payload straight into the buffer it belongs in (``data`` is then a
    view of that buffer, ``raw`` empty): what the receiver's ``place_chunk`` returned for it."""

    def WhichOneof(self, group: str) -> str:
        """``"frame"``: a framed chunk stands where an ``EdgeMessage`` with a frame would."""
        return "frame"


def encode_chunk(
    job_id: str, edge: str, epoch: int, frame_id: int, offset: int, data: bytes | memoryview, last: bool
) -> tuple[bytes, int]:
    """The framed message of one chunk (headers written by hand, the payload joined once) and its
    wire size for credit (``TensorFrame.ByteSize()`` of the chunk)."""
    chunk_head = bytearray()
    if frame_id:
        chunk_head += b"\x08" + _varint(frame_id)
    if offset:
        chunk_head += b"\x10" + _varint(offset)
    if last:
        chunk_head += b"\x20\x01"
    size = len(data)
    if size:
        chunk_head += b"\x1a" + _varint(size)
    chunk_len = len(chunk_head) + size
    frame_head = b"\x12" + _varint(chunk_len)
    frame_len = len(frame_head) + chunk_len
    item_head = b"\x12" + _varint(frame_len)
    item_len = len(item_head) + frame_len
    routed = _field(0x0A, job_id.encode()) + _field(0x12, edge.encode())
    if epoch:
        routed += b"\x20" + _varint(epoch)
    routed += b"\x1a" + _varint(item_len)
    routed_len = len(routed) + item_len
    head = bytes((FRAMED_TAG,)) + _varint(routed_len) + routed + item_head + frame_head + bytes(chunk_head)
    return b"".join((head, data)), frame_len


def is_framed(raw: bytes | memoryview) -> bool:
    """True when ``raw`` (a serialized EdgeMessage or LinkMessage) starts with the framed field."""
    return len(raw) > 0 and raw[0] == FRAMED_TAG


def parse_chunk(raw: bytes) -> FramedChunk:
    """Read a framed chunk's header and return it with a view of the payload; the payload is not copied.

    Anything that is not a framed chunk, or that protobuf would read differently (truncated, wrong or
    repeated fields, field number 0, a varint over 64 bits, a job or edge that is not UTF-8), is a
    FramingError, the one error every hop catches."""
    view = memoryview(raw)
    chunk, _ = _parse(raw, view, len(view))
    return chunk


def peek_chunk(head: memoryview, size: int) -> tuple[FramedChunk, int] | None:
    """The header of a ``size``-byte framed chunk from its first bytes ``head``, and where its payload
    starts: so a receiver can read the payload straight into the buffer it belongs in.

    None unless the header lies wholly in ``head`` and the payload is the last thing in the message
    (as ``encode_chunk`` writes it): then every header byte precedes the payload, and nothing after
    ``head`` is read. Anything else (another layout, a chunk that does not parse) is for
    ``parse_chunk`` on the whole message, which names what is wrong. The chunk's ``data`` is the part
    of the payload already in ``head``."""
    try:
        chunk, (start, stop) = _parse(b"", head, size)
    except (FramingError, IndexError):  # IndexError: a field lies beyond ``head``
        return None
    if stop != size or start > len(head):
        return None
    return chunk, start


def _parse(raw: bytes, view: memoryview, end: int) -> tuple[FramedChunk, tuple[int, int]]:
    """``parse_chunk`` of an ``end``-byte message whose first bytes are ``view``, and the payload's span."""
    if not is_framed(view):
        raise FramingError("not a framed chunk (the first field is not 'framed')")
    length, pos = _read_varint(view, 1, end)
    if pos + length != end:
        raise FramingError(f"framed chunk declares {length} bytes but {end - pos} follow")
    routed = _fields(view, pos, end)
    job_id = _text(view, routed, 1, "job_id")
    edge = _text(view, routed, 2, "edge")
    epoch = _int(routed, 4)
    item = _fields(view, *_span(routed, 3, "item"))
    frame_start, frame_end = _span(item, 2, "frame")
    if set(item) != {2}:
        raise FramingError("framed item is not a tensor frame")
    frame = _fields(view, frame_start, frame_end)
    if set(frame) != {2}:
        raise FramingError("framed tensor frame is not a chunk")
    chunk_start, chunk_end = _span(frame, 2, "chunk")
    chunk = _fields(view, chunk_start, chunk_end)
    data_span = chunk.get(3, (chunk_end, chunk_end))
    if not isinstance(data_span, tuple):
        raise FramingError("framed chunk data should be bytes")
    parsed = FramedChunk(
        raw=raw,
        job_id=job_id,
        edge=edge,
        epoch=epoch,
        frame_id=_int(chunk, 1),
        offset=_int(chunk, 2),
        last=bool(_int(chunk, 4)),
        data=view[data_span[0] : data_span[1]],
        frame_size=frame_end - frame_start,
    )
    return parsed, data_span


__all__ = [
    "FRAMED_FIELD",
    "FRAMED_TAG",
    "LINK_FRAMING_VERSION",
    "MAX_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "FramedChunk",
    "FramingError",
    "chunk_size_for",
    "encode_chunk",
    "framing_refusal",
    "is_framed",
    "parse_chunk",
    "peek_chunk",
]
