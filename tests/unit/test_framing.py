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
