"""Link framing: hand-written chunk bytes are the protobuf messages they claim to be, on every hop."""

from __future__ import annotations

import itertools
import random

import pytest

from nebula_common.proto.nebula.v1 import link_pb2, relay_pb2, tensor_pb2
from nebula_common.rpc.framing import (
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    FramingError,
    as_routed_link_message,
    chunk_size_for,
    encode_chunk,
    is_framed,
    parse_chunk,
    parse_chunk_head,
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
    assert relay_pb2.EdgeMessage.FromString(parsed.edge_message_bytes()) == item
    classic = link_pb2.LinkMessage.FromString(as_routed_link_message(raw))
    assert classic.WhichOneof("body") == "routed"
    assert (classic.routed.job_id, classic.routed.edge, classic.routed.epoch) == (job, edge, epoch)
    assert classic.routed.item == item


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


# ---------------------------------------------------------------- parse_chunk_head (a raw edge's placer)

HEAD_JOBS = ["j", "job-" + "x" * 220, "alice/j\u00f6b \u4e2d\u6587"]
HEAD_EDGES = ["e", "encoder->decoder"]
HEAD_EPOCHS = [0, 1, 300]
HEAD_FRAME_IDS = [0, 1, 70000]
HEAD_OFFSETS = [0, 5, 2**30]
HEAD_SIZES = [1, 200, 70000]


def _payload(size: int) -> bytes:
    return bytes((i * 7 + 3) % 256 for i in range(size))


def _prefix_lengths(data_start: int, total: int) -> list[int]:
    """Every prefix from ``data_start`` to ``total`` for small payloads, a spread of them for big ones."""
    if total - data_start <= 256:
        return list(range(data_start, total + 1))
    picks = {data_start, data_start + 1, data_start + 2, 1024, (data_start + total) // 2, total - 1, total}
    return sorted(length for length in picks if data_start <= length <= total)


def _assert_head_matches_parse(raw: bytes, prefix_len: int) -> None:
    head = parse_chunk_head(raw[:prefix_len], len(raw))
    parsed = parse_chunk(raw)
    assert head is not None, f"no head from a {prefix_len}-byte prefix of a {len(raw)}-byte chunk"
    assert (head.job_id, head.edge, head.epoch) == (parsed.job_id, parsed.edge, parsed.epoch)
    assert (head.frame_id, head.offset, head.last) == (parsed.frame_id, parsed.offset, parsed.last)
    assert head.frame_size == parsed.frame_size
    assert head.item == parsed.item
    assert head.total == len(raw)
    assert head.data_size == len(parsed.data) == len(raw) - head.data_start
    assert raw[head.data_start :] == bytes(parsed.data)


@pytest.mark.parametrize("job", HEAD_JOBS, ids=["short", "long", "non-ascii"])
@pytest.mark.parametrize("size", HEAD_SIZES)
def test_chunk_head_from_any_prefix_reaching_the_payload_agrees_with_parse_chunk(job: str, size: int) -> None:
    payload = _payload(size)
    for edge, epoch, frame_id, offset, last in itertools.product(
        HEAD_EDGES, HEAD_EPOCHS, HEAD_FRAME_IDS, HEAD_OFFSETS, (False, True)
    ):
        raw, frame_size = encode_chunk(job, edge, epoch, frame_id, offset, memoryview(payload), last)
        whole = parse_chunk_head(raw, len(raw))
        assert whole is not None
        assert whole.frame_size == frame_size
        assert (whole.job_id, whole.edge, whole.epoch) == (job, edge, epoch)
        assert (whole.frame_id, whole.offset, whole.last) == (frame_id, offset, last)
        for prefix_len in _prefix_lengths(whole.data_start, len(raw)):
            _assert_head_matches_parse(raw, prefix_len)
        # A memoryview prefix (what the I/O thread passes) reads the same.
        assert parse_chunk_head(memoryview(raw)[: whole.data_start], len(raw)) == whole


@pytest.mark.parametrize("job", HEAD_JOBS, ids=["short", "long", "non-ascii"])
def test_chunk_head_is_none_when_the_prefix_stops_one_byte_short_of_the_payload(job: str) -> None:
    for size, epoch, frame_id, offset in itertools.product(
        HEAD_SIZES, HEAD_EPOCHS, HEAD_FRAME_IDS, HEAD_OFFSETS
    ):
        raw, _ = encode_chunk(job, "e", epoch, frame_id, offset, _payload(size), size == 200)
        head = parse_chunk_head(raw, len(raw))
        assert head is not None
        for short in range(head.data_start):  # one byte short, and every shorter prefix too
            assert parse_chunk_head(raw[:short], len(raw)) is None, (short, head.data_start)


def test_chunk_head_is_none_for_a_message_that_is_not_framed() -> None:
    chunk = tensor_pb2.TensorChunk(frame_id=3, offset=0, data=b"z" * 5000, last=True)
    messages = [
        relay_pb2.EdgeMessage(frame=tensor_pb2.TensorFrame(chunk=chunk)),
        relay_pb2.EdgeMessage(
            frame=tensor_pb2.TensorFrame(header=tensor_pb2.TensorHeader(frame_id=3, payload_size=9))
        ),
        relay_pb2.EdgeMessage(signal=relay_pb2.EdgeSignal(seq=4, kind=relay_pb2.SIGNAL_KIND_SYNC)),
    ]
    for message in messages:
        raw = message.SerializeToString()
        for prefix_len in sorted({0, 1, 2, 16, min(len(raw), 1024), len(raw)}):
            assert parse_chunk_head(raw[:prefix_len], len(raw)) is None


def _ld(tag: int, body: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return bytes((tag,)) + _uvarint(len(body)) + body


def _uvarint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _reordered_chunks() -> list[tuple[str, bytes]]:
    """Framed chunks (valid protobuf) whose fields are not in ``encode_chunk``'s order (payload last)."""
    data = _payload(3000)
    chunk_in_order = b"\x08" + _uvarint(9) + b"\x10" + _uvarint(40) + b"\x20\x01" + _ld(0x1A, data)
    chunk_data_first = _ld(0x1A, data) + b"\x08" + _uvarint(9) + b"\x10" + _uvarint(40) + b"\x20\x01"
    chunk_last_after = b"\x08" + _uvarint(9) + b"\x10" + _uvarint(40) + _ld(0x1A, data) + b"\x20\x01"

    def item(chunk: bytes) -> bytes:
        return _ld(0x12, _ld(0x12, chunk))  # EdgeMessage.frame{TensorFrame.chunk{...}}

    def framed(routed: bytes) -> bytes:
        return _ld(0x4A, routed)

    job, edge, epoch = _ld(0x0A, b"j"), _ld(0x12, b"e"), b"\x20" + _uvarint(2)
    return [
        ("epoch after the item", framed(job + edge + _ld(0x1A, item(chunk_in_order)) + epoch)),
        ("job id after the item", framed(edge + epoch + _ld(0x1A, item(chunk_in_order)) + job)),
        ("data before the chunk's numbers", framed(job + edge + epoch + _ld(0x1A, item(chunk_data_first)))),
        ("last after the data", framed(job + edge + epoch + _ld(0x1A, item(chunk_last_after)))),
    ]


@pytest.mark.parametrize(
    ("layout", "raw"), _reordered_chunks(), ids=[name for name, _ in _reordered_chunks()]
)
def test_chunk_head_is_none_for_another_field_order_that_parse_chunk_still_reads(
    layout: str, raw: bytes
) -> None:
    parsed = parse_chunk(raw)  # any field order is a valid framed chunk ...
    assert (parsed.job_id, parsed.edge, parsed.epoch) == ("j", "e", 2)
    assert (parsed.frame_id, parsed.offset, parsed.last) == (9, 40, True)
    assert parsed.data.tobytes() == _payload(3000)
    as_edge = relay_pb2.EdgeMessage.FromString(raw)
    assert as_edge.framed.item.frame.chunk.data == _payload(3000)
    for prefix_len in sorted({1, 10, 30, min(1024, len(raw)), len(raw)}):  # ... but not one to place
        assert parse_chunk_head(raw[:prefix_len], len(raw)) is None, (layout, prefix_len)


def test_chunk_head_is_none_when_the_declared_length_does_not_match_the_total() -> None:
    raw, _ = encode_chunk("j", "e", 1, 2, 0, _payload(5000), False)
    head = parse_chunk_head(raw, len(raw))
    assert head is not None
    for total in (0, head.data_start, len(raw) - 1, len(raw) + 1, len(raw) + 1000, 2 * len(raw)):
        assert parse_chunk_head(raw[:1024], total) is None, total
        assert parse_chunk_head(raw, total) is None, total


@pytest.mark.parametrize(
    "garbage",
    [
        b"",
        b"\x4a",
        b"\x4a\xff",
        b"\x4a\xff\xff\xff",
        b"\x4a" + b"\xff" * 12,  # a varint longer than 10 bytes
        b"\x4a\x10\x0a\x05j",  # job id truncated
        b"\x4a\x10\x0a\x01j\x12\x01e\x1a\xff",  # item length truncated
        b"\x4a\x10\x0a\x01j\x12\x01e\x21abcdefgh",  # a fixed64 field (wire type 1)
        b"\x4a\x10\x0d\x00\x00\x00\x00",  # a fixed32 field (wire type 5)
        b"\x4a\x10\x0a\x02\xff\xfe\x12\x01e\x1a\x05\x12\x03\x12\x01\x1a",  # a job id that is not UTF-8
        b"\x4a\x0a\x0a\x01j\x12\x01e\x1a\x03\x12\x01\x1a",  # frame holding a bare data tag
        b"\x4a\x08\x1a\x06\x12\x04\x12\x02\x1a\x00",  # no job id nor edge
        b"\x4a\x0a\x0a\x01j\x12\x01e\x1a\x03\x12\x01\x08",  # frame content is a varint field
    ],
)
def test_chunk_head_is_none_for_garbage_bytes(garbage: bytes) -> None:
    for total in sorted({*range(40), len(garbage) + 1, 1 << 20}):  # the declared length among them
        assert parse_chunk_head(garbage, total) is None


def test_chunk_head_never_raises_on_random_or_mutated_bytes() -> None:
    rng = random.Random(20261126)
    raw, _ = encode_chunk("job", "up->down", 3, 9, 77, _payload(2000), True)
    good = parse_chunk_head(raw, len(raw))
    assert good is not None
    for _ in range(20000):
        if rng.random() < 0.5:
            sample = bytearray(rng.randbytes(rng.randint(0, 64)))
        else:
            sample = bytearray(raw[: rng.randint(0, good.data_start + 8)])
            for _ in range(rng.randint(1, 3)):
                if sample:
                    sample[rng.randrange(len(sample))] = rng.randrange(256)
        if sample and rng.random() < 0.5:
            sample[0] = 0x4A  # framed-looking, so the parser goes past the first byte
        total = rng.choice([len(raw), len(sample), rng.randint(0, 1 << 16)])
        head = parse_chunk_head(bytes(sample), total)  # must not raise
        if head is not None and total == len(raw):
            # Whatever it accepts is a framed chunk parse_chunk reads the same way.
            whole = bytes(sample[: head.data_start]) + raw[good.data_start :]
            if len(whole) == total:
                parsed = parse_chunk(whole)
                assert (parsed.frame_id, parsed.offset, parsed.last) == (
                    head.frame_id,
                    head.offset,
                    head.last,
                )
                assert (parsed.job_id, parsed.edge, parsed.epoch) == (head.job_id, head.edge, head.epoch)
