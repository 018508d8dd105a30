"""Link framing: hand-written chunk bytes are the protobuf messages they claim to be, on every hop."""

from __future__ import annotations

import pytest

from nebula_common.proto.nebula.v1 import link_pb2, relay_pb2, tensor_pb2
from nebula_common.rpc.framing import (
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    FramingError,
    chunk_size_for,
    encode_chunk,
    is_framed,
    parse_chunk,
    peek_chunk,
)

CASES = [
    # job, edge, epoch, frame_id, offset, payload, last
    ("job-1", "up->down", 0, 1, 0, b"", True),
    ("j", "e", 3, 7, 4 << 20, bytes(range(256)) * 9, False),
    ("alice/job \u00e9", "encoder->decoder", 1 << 40, 1 << 33, 300, b"\x00" * 200_000, True),
]


@pytest.mark.parametrize(("job", "edge", "epoch", "frame_id", "offset", "payload", "last"), CASES)
def test_round_trip_matches_protobuf(
    job: str, edge: str, epoch: int, frame_id: int, offset: int, payload: bytes, last: bool
) -> None:
    raw, frame_size = encode_chunk(job, edge, epoch, frame_id, offset, memoryview(payload), last)
    chunk = tensor_pb2.TensorChunk(frame_id=frame_id, offset=offset, data=payload, last=last)
    frame = tensor_pb2.TensorFrame(chunk=chunk)
    item = relay_pb2.EdgeMessage(frame=frame)
    # The same bytes parse as an EdgeMessage (trainer <-> switch) and as a LinkMessage (switch <-> switch).
    as_edge = relay_pb2.EdgeMessage.FromString(raw)
    as_link = link_pb2.LinkMessage.FromString(raw)
    for framed in (as_edge.framed, as_link.framed):
        assert (framed.job_id, framed.edge, framed.epoch) == (job, edge, epoch)
        assert framed.item == item
    assert frame_size == frame.ByteSize()  # the credit unit of the delivery contract
    parsed = parse_chunk(raw)
    assert (parsed.job_id, parsed.edge, parsed.epoch) == (job, edge, epoch)
    assert (parsed.frame_id, parsed.offset, parsed.last) == (frame_id, offset, last)
    assert parsed.data.tobytes() == payload
    assert parsed.frame_size == frame_size


def test_payload_is_a_view_not_a_copy() -> None:
    raw, _ = encode_chunk("j", "e", 0, 1, 0, b"abc" * 1000, True)
    parsed = parse_chunk(raw)
    assert parsed.data.obj is raw


def test_protobuf_serialized_framed_item_parses_too() -> None:
    """A framed item written by a protobuf serializer (any field order) is read the same way."""
    chunk = tensor_pb2.TensorChunk(frame_id=5, offset=10, data=b"xyz", last=True)
    message = relay_pb2.EdgeMessage(
        framed=relay_pb2.FramedItem(
            job_id="j",
            edge="e",
            epoch=2,
            item=relay_pb2.EdgeMessage(frame=tensor_pb2.TensorFrame(chunk=chunk)),
        )
    )
    raw = message.SerializeToString()
    assert is_framed(raw)
    parsed = parse_chunk(raw)
    assert (parsed.job_id, parsed.edge, parsed.epoch, parsed.frame_id, parsed.offset) == ("j", "e", 2, 5, 10)
    assert parsed.data.tobytes() == b"xyz" and parsed.last


@pytest.mark.parametrize(
    ("raw", "complaint"),
    [
        (b"\x12\x00", "not a framed chunk"),
        (b"\x4a\x05\x0a\x01j", "declares 5 bytes"),
        (b"\x4a\x03\x0a\x01j", "no edge"),
        (b"\x4a\x02\x0a\x05", "truncated"),
    ],
)
def test_malformed_bytes_are_refused_with_a_reason(raw: bytes, complaint: str) -> None:
    with pytest.raises(FramingError, match=complaint):
        parse_chunk(raw)


def test_framed_item_that_is_not_a_chunk_is_refused() -> None:
    header = relay_pb2.EdgeMessage(frame=tensor_pb2.TensorFrame(header=tensor_pb2.TensorHeader(frame_id=1)))
    raw = relay_pb2.EdgeMessage(
        framed=relay_pb2.FramedItem(job_id="j", edge="e", item=header)
    ).SerializeToString()
    with pytest.raises(FramingError, match="not a chunk"):
        parse_chunk(raw)


def test_chunk_size_follows_the_window_within_bounds() -> None:
    assert chunk_size_for(8 << 20) == 1 << 20
    assert chunk_size_for(1 << 20) == MIN_CHUNK_BYTES
    assert chunk_size_for(1 << 30) == MAX_CHUNK_BYTES


@pytest.mark.parametrize(("job", "edge", "epoch", "frame_id", "offset", "payload", "last"), CASES[1:])
def test_a_chunks_header_is_read_from_its_first_bytes_as_from_the_whole(
    job: str, edge: str, epoch: int, frame_id: int, offset: int, payload: bytes, last: bool
) -> None:
    raw, _ = encode_chunk(job, edge, epoch, frame_id, offset, memoryview(payload), last)
    whole = parse_chunk(raw)
    peeked = peek_chunk(memoryview(raw)[:1024], len(raw))
    assert peeked is not None
    chunk, start = peeked
    assert (chunk.job_id, chunk.edge, chunk.epoch, chunk.frame_id, chunk.offset, chunk.last) == (
        job,
        edge,
        epoch,
        frame_id,
        offset,
        last,
    )
    assert chunk.frame_size == whole.frame_size
    assert raw[start:] == payload and chunk.data.tobytes() == payload[: 1024 - start]
    # A head that ends inside the header: nothing to say, the whole message decides.
    assert peek_chunk(memoryview(raw)[: start - 1], len(raw)) is None


def test_a_chunk_whose_payload_is_not_last_is_not_peeked() -> None:
    """protobuf writes ``last`` (field 4) after ``data`` (field 3): a valid chunk, parsed whole, but the
    bytes after its first ones are not all payload, so nothing may be read straight into a frame."""
    payload = bytes(range(256)) * 300
    chunk = tensor_pb2.TensorChunk(frame_id=5, offset=0, data=payload, last=True)
    raw = relay_pb2.EdgeMessage(
        framed=relay_pb2.FramedItem(
            job_id="j", edge="e", item=relay_pb2.EdgeMessage(frame=tensor_pb2.TensorFrame(chunk=chunk))
        )
    ).SerializeToString()
    assert parse_chunk(raw).data.tobytes() == payload and raw.endswith(b"\x20\x01")
    assert peek_chunk(memoryview(raw)[:1024], len(raw)) is None


def test_a_chunk_followed_by_other_fields_is_not_peeked() -> None:
    """A framed item whose job id comes after its chunk (protobuf allows any order): the bytes after
    the payload are the job id, not payload, so the first bytes alone must not place anything."""

    def field(tag: int, body: bytes) -> bytes:
        return bytes([tag]) + varint(len(body)) + body

    def varint(value: int) -> bytes:
        out = bytearray()
        while value >= 0x80:
            out.append(value & 0x7F | 0x80)
            value >>= 7
        return bytes(out + bytes([value]))

    chunk = b"\x08\x05" + b"\x20\x01" + field(0x1A, b"payload!")
    item = field(0x12, field(0x12, chunk))  # EdgeMessage{frame: TensorFrame{chunk}}
    routed = field(0x1A, item) + field(0x12, b"e") + field(0x0A, b"j" * 70_000)
    raw = field(0x4A, routed)
    whole = parse_chunk(raw)
    assert whole.data.tobytes() == b"payload!" and whole.job_id == "j" * 70_000
    assert peek_chunk(memoryview(raw)[:1024], len(raw)) is None


def test_peeking_never_reads_a_header_the_whole_message_would_not() -> None:
    """Mutated chunks: whatever the first bytes say is what parse_chunk says of the whole, or None."""
    import random

    rng = random.Random(7)
    raw, _ = encode_chunk("job-1", "up->down", 2, 9, 1 << 21, bytes(range(256)) * 400, False)
    agreed = declined = 0
    for _ in range(3000):
        mutated = bytearray(raw)
        for _ in range(rng.randint(1, 3)):
            mutated[rng.randrange(60)] = rng.randrange(256)  # the header lies in the first ~40 bytes
        cut = rng.choice([len(mutated), len(mutated) - rng.randint(1, 50)])
        message = bytes(mutated[:cut])
        peeked = peek_chunk(memoryview(message)[:1024], len(message))
        if peeked is None:
            declined += 1
            continue
        chunk, start = peeked
        whole = parse_chunk(message)  # a header peeking accepted must parse whole, the same
        assert (whole.job_id, whole.edge, whole.epoch, whole.frame_id, whole.offset, whole.last) == (
            chunk.job_id,
            chunk.edge,
            chunk.epoch,
            chunk.frame_id,
            chunk.offset,
            chunk.last,
        )
        assert whole.frame_size == chunk.frame_size
        assert whole.data.obj is message and len(message) - len(whole.data) == start
        agreed += 1
    assert agreed > 100 and declined > 100, (agreed, declined)
