"""Fuzzing the data path's parsers, part 1: the byte streams between switches and trainers.

Issue "One data plane", item 2. Each parser gets arbitrary bytes, real messages from the real encoder
mutated (bits flipped, cut, extended, spliced, a length made huge) and round trips. The outcome is a
valid result or the parser's documented error, never another exception, a hang, or a buffer sized from
a length over the limit:

* framed chunks (``nebula_common/rpc/framing.py``): ``parse_chunk`` -> FramingError; what it accepts,
  protobuf reads the same (the module's promise: "any parser reads them");
* raw records (``raw_records.py``: a ``RawConnection`` reading one end of a socket pair) -> exactly the
  stream's whole records, then ``grpc.aio.EOF`` or RawConnectionError;
* sealed records (``sealed_records.py``, ``sealed_receive.py``): a header, checked against the message
  in progress -> SealedRecordError; a stream of records (messages in several parts too) fed to the
  receiving state machine piece by piece, or read by a sealed ``RawConnection``, changed anywhere,
  delivers exactly the messages before the change, then fails with SealedRecordError (never altered
  plaintext); one stopped inside a record ends with the read timeout, not a hang.

The helpers here (``fuzz``, ``MUTATIONS``, ...) serve the other two parts too:
``test_data_path_fuzz_control.py`` (the sealed-records negotiation, the WAN port's first bytes, link
handshakes, the stage channel) and ``test_data_path_fuzz_payloads.py`` (tensors, fragments).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import tracemalloc
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from nebula_common.proto.nebula.v1 import link_pb2, relay_pb2
from nebula_common.rpc.framing import FRAMED_TAG, FramingError, encode_chunk, is_framed, parse_chunk
from nebula_common.rpc.raw_record_bounds import END, MAX_MESSAGE_BYTES
from nebula_common.rpc.raw_records import RawConnection, RawConnectionError
from nebula_common.rpc.sealed_receive import SealedReceiver
from nebula_common.rpc.sealed_records import (
    CLOSE,
    HEADER,
    LAST,
    MAX_RECORD_BYTES,
    PART,
    RecordSealing,
    SealedRecordError,
    parse_header,
    sealed_size,
)

T = TypeVar("T")
STEP_S = 10.0
"""Bound of one read or one connection's handling: an outcome comes well before it (else: a hang)."""


def fuzz(examples: int) -> settings:
    """Deterministic runs (the same examples every time, no database), no per-example deadline."""
    return settings(
        max_examples=examples,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def run_bounded(body: Callable[[], Awaitable[T]]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(body(), 2 * STEP_S)

    return asyncio.run(bounded())


def peak_while(action: Callable[[], object]) -> int:
    """Peak bytes allocated (by every thread) while ``action`` runs."""
    tracemalloc.start()
    try:
        action()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


# ----- mutations of real messages ------------------------------------------------------------------
HUGE = [b"\xff" * 9 + b"\x01", b"\xff\xff\xff\xff", (MAX_MESSAGE_BYTES + 1).to_bytes(4, "big"), b"\x80" * 11]
"""Bytes that read as a huge length (a 10-byte varint, 4-byte lengths past the limit) or as none."""
_AT = st.integers(0, 1 << 16)
MUTATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("flip"), _AT, st.integers(0, 7)),
        st.tuples(st.just("cut"), _AT),
        st.tuples(st.just("insert"), _AT, st.binary(min_size=1, max_size=8)),
        st.tuples(st.just("drop"), _AT, st.integers(1, 8)),
        st.tuples(st.just("splice"), _AT, _AT, st.integers(1, 48)),
        st.tuples(st.just("huge"), _AT, st.sampled_from(HUGE)),
    ),
    min_size=1,
    max_size=3,
)


def mutated(data: bytes, mutations: list[tuple]) -> bytes:
    """``data`` with each mutation applied (positions wrap around the current length)."""
    out = bytearray(data)
    for kind, at, *arg in mutations:
        at %= len(out) + 1
        if kind == "flip" and at < len(out):
            out[at] ^= 1 << arg[0]
        elif kind == "cut":
            del out[at:]
        elif kind == "insert":
            out[at:at] = arg[0]
        elif kind == "drop":
            del out[at : at + arg[0]]
        elif kind == "splice":  # a copy of another part of the message, inserted here
            source = arg[0] % (len(out) + 1)
            out[at:at] = out[source : source + arg[1]]
        elif kind == "huge":
            out[at : at + len(arg[0])] = arg[0]
    return bytes(out)


# ----- framed chunks -------------------------------------------------------------------------------
_U64 = st.integers(0, (1 << 64) - 1)
CHUNKS = st.tuples(
    st.text(max_size=12), st.text(max_size=12), _U64, _U64, _U64, st.binary(max_size=40), st.booleans()
)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out) + bytes((value,))


def field(tag: int, body: bytes) -> bytes:
    """One length-delimited protobuf field (``tag`` is the key byte)."""
    return bytes((tag,)) + _varint(len(body)) + body


def _framed(routed: bytes) -> bytes:
    return field(FRAMED_TAG, routed)


def _item(chunk_fields: bytes) -> bytes:
    return field(0x1A, field(0x12, field(0x12, chunk_fields)))


def _chunk_agrees_with_protobuf(raw: bytes) -> None:
    """What ``parse_chunk`` accepted, protobuf reads as the same chunk (an EdgeMessage, a LinkMessage)."""
    chunk = parse_chunk(raw)
    assert chunk.data.obj is raw and chunk.frame_size <= len(raw)
    for message in (relay_pb2.EdgeMessage.FromString(raw), link_pb2.LinkMessage.FromString(raw)):
        framed = message.framed
        assert message.WhichOneof("body") == "framed" and framed.item.frame.WhichOneof("part") == "chunk"
        want = framed.item.frame.chunk
        assert (chunk.job_id, chunk.edge, chunk.epoch) == (framed.job_id, framed.edge, framed.epoch)
        assert (chunk.frame_id, chunk.offset, chunk.last) == (want.frame_id, want.offset, want.last)
        assert chunk.data.tobytes() == want.data


@fuzz(300)
@given(raw=st.one_of(st.binary(max_size=64), st.binary(max_size=64).map(lambda b: bytes((FRAMED_TAG,)) + b)))
@example(raw=b"")
@example(raw=bytes((FRAMED_TAG,)) + b"\xff" * 10)  # a length varint that never ends
def test_arbitrary_bytes_are_a_chunk_or_a_framing_error(raw: bytes) -> None:
    assert is_framed(raw) == is_framed(memoryview(raw)) == (raw[:1] == bytes((FRAMED_TAG,)))
    with contextlib.suppress(FramingError):
        _chunk_agrees_with_protobuf(raw)


@fuzz(500)
@given(chunk=CHUNKS, mutations=st.one_of(st.just([]), MUTATIONS))
# A job id that is not UTF-8 raised UnicodeDecodeError, which the hops catching FramingError let through.
@example(chunk=("j\u00e9", "e", 1, 2, 3, b"abc", True), mutations=[("flip", 5, 6)])
# A 10th varint byte above 1: this reader said frame_id 2**65 - 1, protobuf keeps the low 64 bits.
@example(chunk=("", "", 0, 1 << 63, 0, b"", False), mutations=[("huge", 13, b"\xff" * 9 + b"\x03")])
def test_chunks_round_trip_and_changed_ones_are_refused_or_read_as_protobuf_reads_them(
    chunk: tuple, mutations: list
) -> None:
    raw, frame_size = encode_chunk(*chunk)
    if not mutations:  # what the encoder wrote reads back whole, from bytes or a raw link's view
        for received in (raw, memoryview(raw)):
            parsed = parse_chunk(received)  # type: ignore[arg-type]
            fields = (parsed.job_id, parsed.edge, parsed.epoch, parsed.frame_id, parsed.offset)
            assert (*fields, parsed.data.tobytes(), parsed.last) == chunk and parsed.frame_size == frame_size
    with contextlib.suppress(FramingError):
        _chunk_agrees_with_protobuf(mutated(raw, mutations))


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        # The routed item twice: protobuf merges the two (frame_id 5), this reader kept the last (0).
        (
            _framed(field(0x0A, b"j") + field(0x12, b"e") + _item(b"\x08\x05") + _item(b"\x1a\x01x")),
            "repeats",
        ),
        (_framed(field(0x0A, b"j") + field(0x12, b"e") + b"\x00\x01" + _item(b"")), "field number 0"),
        (_framed(field(0x0A, b"\xff") + field(0x12, b"e") + _item(b"")), "job_id is not UTF-8"),
        (_framed(field(0x0A, b"j") + field(0x12, b"e") + _item(b"\x08" + b"\xff" * 9 + b"\x02")), "64 bits"),
    ],
    ids=["repeated-field", "field-number-0", "job-not-utf8", "varint-over-64-bits"],
)
def test_chunks_protobuf_would_read_otherwise_are_refused_by_name(raw: bytes, named: str) -> None:
    with pytest.raises(FramingError, match=named):
        parse_chunk(raw)


@pytest.mark.parametrize("claimed", [1 << 62, (1 << 64) - 1, MAX_MESSAGE_BYTES + 1])
def test_a_chunk_claiming_more_bytes_than_follow_is_refused_without_allocating_them(claimed: int) -> None:
    outer = bytes((FRAMED_TAG,)) + _varint(claimed) + b"\x0a\x01j"
    inner = _framed(field(0x0A, b"j") + field(0x12, b"e") + b"\x1a" + _varint(claimed) + b"\x12\x00")

    def refuse() -> None:
        for raw in (outer, inner):
            with pytest.raises(FramingError, match=f"declares {claimed} bytes|needs {claimed} bytes"):
                parse_chunk(raw)

    assert peak_while(refuse) < 64 << 10


# ----- raw and sealed records, read by RawConnection --------------------------------------------
def read_stream(
    stream: bytes, sealing: RecordSealing | None = None, read_timeout_s: float = STEP_S, ends: bool = True
) -> tuple[list[bytes], object]:
    """What a switch's RawConnection (``views``) reads from a peer that sent ``stream`` and ended its
    side (or, without ``ends``, stopped sending): (the messages, then ``grpc.aio.EOF`` or the
    RawConnectionError)."""

    async def body() -> tuple[list[bytes], object]:
        peer, ours = socket.socketpair()
        peer.settimeout(STEP_S)
        peer.sendall(stream)  # before the reader starts: the streams here fit the socket buffer
        if ends:
            peer.shutdown(socket.SHUT_WR)
        connection = RawConnection(
            ours,
            "fuzz",
            asyncio.get_running_loop(),
            views=True,
            sealing=sealing,
            read_timeout_s=read_timeout_s,
        )
        got: list[bytes] = []
        try:
            while True:
                try:
                    item = await asyncio.wait_for(connection.read(), STEP_S)
                except RawConnectionError as exc:
                    return got, exc
                except TimeoutError:
                    pytest.fail(f"nothing read for {STEP_S} s after {len(got)} messages: a hang")
                if item is grpc.aio.EOF:
                    return got, item
                got.append(bytes(item))  # type: ignore[call-overload]
        finally:
            await connection.close()
            peer.close()

    return run_bounded(body)


def expected_records(stream: bytes) -> tuple[list[bytes], str]:
    """A correct reading of ``4-byte length + bytes`` records: the whole records, then how it ends."""
    position, records = 0, []
    while position < len(stream):
        size = int.from_bytes(stream[position : position + 4], "big")
        if len(stream) - position >= 4 and size > MAX_MESSAGE_BYTES:
            return records, "limit"
        if position + 4 + size > len(stream):
            return records, "ended inside a record"
        records.append(stream[position + 4 : position + 4 + size])
        position += 4 + size
    return records, "eof"


MESSAGES = st.lists(st.binary(max_size=300), max_size=6)


def _records(messages: list[bytes]) -> bytes:
    return b"".join(len(message).to_bytes(4, "big") + message for message in messages)


@fuzz(60)
@given(
    stream=st.one_of(
        st.binary(max_size=48),
        st.tuples(MESSAGES, st.one_of(st.just([]), MUTATIONS)).map(lambda m: mutated(_records(m[0]), m[1])),
    )
)
@example(stream=b"\x00\x00")
@example(stream=_records([b"", b"a" * 70_000, b"b"]))  # over SMALL_MESSAGE: received into a buffer of its own
def test_raw_records_read_exactly_the_whole_records_then_end_or_fail(stream: bytes) -> None:
    records, end = expected_records(stream)
    event(end)  # --hypothesis-show-statistics: how the streams end
    got, outcome = read_stream(stream)
    assert got == records
    if end == "eof":
        assert outcome is grpc.aio.EOF
    else:
        assert isinstance(outcome, RawConnectionError) and end in str(outcome)


SECRETS = (bytes(range(32)), bytes(range(32, 64)))
LIMIT = 512
"""A small key budget: the fuzzed streams move to the next key (both ends at the same record)."""
RECORD = 96
"""The fuzzed writer's record size: messages over it go as several parts."""


def sealed_stream(messages: list[bytes], close: bool) -> tuple[bytes, list[int]]:
    """The sealed records of ``messages`` (then a CLOSE), and the end offset of each message's last one."""
    writer = RecordSealing(SECRETS[0], SECRETS[1], limit_bytes=LIMIT, limit_records=5, record_bytes=RECORD)
    out, ends = bytearray(), []
    for message in messages:
        record = bytearray(sealed_size(len(message), RECORD))
        assert writer.seal_into(message, memoryview(record)) == len(record)
        out += record
        ends.append(len(out))
    if close:
        record = bytearray(sealed_size(0))
        writer.seal_close_into(memoryview(record))
        out += record
        ends.append(len(out))
    return bytes(out), ends


def _reader() -> RecordSealing:
    return RecordSealing(SECRETS[1], SECRETS[0], limit_bytes=LIMIT, limit_records=5)


def receive_pieces(stream: bytes, piece: int) -> tuple[list[bytes], object]:
    """Drive a SealedReceiver with ``stream`` as a reader would, ``piece`` bytes at a time at most: the
    messages, then END, ``"cut"`` (the stream stopped) or the SealedRecordError."""
    receiver, got = SealedReceiver(_reader(), views=True), []
    position, need, heading = 0, receiver.header_size, True
    buffer = b""
    while True:
        while len(buffer) < need:
            if position >= len(stream):
                return got, "cut"
            take = stream[position : position + min(piece, need - len(buffer))]
            buffer += take
            position += len(take)
        try:
            if heading:
                need, heading = receiver.header(buffer), False
            else:
                message = receiver.body(memoryview(buffer))
                need, heading = receiver.header_size, True
                if message is END:
                    return got, END
                if message is not None:
                    got.append(bytes(message))  # type: ignore[arg-type]
        except SealedRecordError as exc:
            return got, exc
        buffer = b""


MESSAGES_IN_PARTS = st.lists(st.binary(max_size=300), max_size=5)


def _intact(original: bytes, stream: bytes, ends: list[int]) -> int:
    """How many messages of ``original`` (ending at ``ends``) lie wholly before ``stream``'s first change."""
    if stream == original:
        return len(ends)
    common = min(len(original), len(stream))
    change = next((i for i in range(common) if original[i] != stream[i]), common)
    return sum(1 for end in ends if end <= change)


@fuzz(300)
@given(
    messages=MESSAGES_IN_PARTS,
    close=st.booleans(),
    mutations=st.one_of(st.just([]), MUTATIONS),
    piece=st.integers(1, 200),
)
@example(messages=[b"x" * 400, b"y" * 200, b"z" * 400], close=True, mutations=[], piece=7)  # keys move on
@example(messages=[b"a" * 200], close=True, mutations=[("flip", 0, 0), ("flip", 0, 1)], piece=200)
def test_the_sealed_receiver_delivers_exactly_the_messages_before_any_change(
    messages: list[bytes], close: bool, mutations: list, piece: int
) -> None:
    original, ends = sealed_stream(messages, close)
    stream = mutated(original, mutations)
    intact = _intact(original, stream, ends)
    got, outcome = receive_pieces(stream, piece)
    expected = messages[: min(intact, len(messages))]
    assert got == expected, "a sealed receiver delivered a changed or extra message"
    if stream == original or (close and intact == len(ends)):  # after an intact close: nothing read
        assert outcome is (END if close else "cut")
    else:
        assert outcome == "cut" or isinstance(outcome, SealedRecordError), outcome


@fuzz(60)
@given(messages=MESSAGES, close=st.booleans(), mutations=st.one_of(st.just([]), MUTATIONS))
@example(messages=[b"x" * 400, b"y" * 200, b"z" * 400], close=True, mutations=[])  # the key moves on twice
@example(messages=[b""], close=True, mutations=[("flip", 0, 0), ("flip", 0, 1)])  # LAST -> CLOSE: refused
def test_a_sealed_stream_delivers_exactly_the_records_before_any_change(
    messages: list[bytes], close: bool, mutations: list
) -> None:
    original, ends = sealed_stream(messages, close)
    stream = mutated(original, mutations)
    intact = _intact(original, stream, ends)
    got, outcome = read_stream(stream, _reader())
    event(f"{'eof' if outcome is grpc.aio.EOF else 'refused'} after {intact} of {len(ends)} records")
    assert got == messages[: min(intact, len(messages))], "a sealed reader delivered a changed message"
    if close and intact == len(ends):
        assert outcome is grpc.aio.EOF
    else:
        assert isinstance(outcome, RawConnectionError), "a changed or cut sealed stream ended cleanly"
        assert isinstance(outcome.__cause__, SealedRecordError), repr(outcome.__cause__)


@pytest.mark.parametrize(
    "cut", [1, HEADER.size, HEADER.size + 5, -1], ids=["header", "body", "inside", "tag"]
)
def test_a_peer_that_stops_inside_a_sealed_message_meets_the_read_timeout(cut: int) -> None:
    stream, _ = sealed_stream([b"whole", b"m" * 300], close=False)
    first = sealed_size(5, RECORD)
    stopped = stream[: first + (cut if cut > 0 else sealed_size(RECORD, RECORD) + cut)]
    got, outcome = read_stream(stopped, _reader(), read_timeout_s=0.3, ends=False)
    assert got == [b"whole"]
    assert isinstance(outcome, RawConnectionError) and "peer stalled" in str(outcome), outcome


@pytest.mark.parametrize(
    ("stream", "sealed", "named"),
    [
        ((MAX_MESSAGE_BYTES + 1).to_bytes(4, "big") + b"x" * 64, False, "limit"),
        (b"\xff\xff\xff\xff", False, "limit"),
        (HEADER.pack(LAST, 16, MAX_MESSAGE_BYTES + 1) + b"x" * 64, True, "limit"),
        (HEADER.pack(PART, MAX_RECORD_BYTES + 1, MAX_MESSAGE_BYTES) + b"x" * 64, True, "limit"),
        (HEADER.pack(LAST, (1 << 32) - 1, (1 << 32) - 1), True, "limit"),
        (HEADER.pack(7, 16, 16), True, "unknown kind 7"),
        (HEADER.pack(CLOSE, 1 << 20, 0), True, "a close carries none"),
    ],
    ids=[
        "raw-over-limit",
        "raw-4GiB",
        "sealed-message-over-limit",
        "sealed-record-over-limit",
        "sealed-4GiB",
        "sealed-unknown-kind",
        "sealed-close-with-bytes",
    ],
)
def test_a_record_claiming_more_than_the_limit_is_refused_before_a_buffer_is_sized(
    stream: bytes, sealed: bool, named: str
) -> None:
    outcome: list[object] = []
    peak = peak_while(lambda: outcome.extend(read_stream(stream, _reader() if sealed else None)))
    got, end = outcome
    assert got == [] and isinstance(end, RawConnectionError) and named in str(end)
    assert peak < 8 << 20, f"{peak} bytes allocated to refuse {stream[:5].hex()} (its fixed buffers: 2 MiB)"


def _valid_header(kind: int, length: int, message: int, offset: int, total: int) -> bool:
    """What a sender of sealed records can write next, ``offset`` bytes into a message of ``total``."""
    if kind == CLOSE:
        return length == message == 0 and offset == 0
    if kind not in (PART, LAST) or length > MAX_RECORD_BYTES or message > MAX_MESSAGE_BYTES:
        return False
    if offset and message != total:
        return False
    if kind == PART:
        return length > 0 and offset + length < message
    return offset + length == message


_LENGTHS = st.one_of(st.integers(0, 300), st.integers(0, (1 << 32) - 1), st.just(MAX_RECORD_BYTES))


@fuzz(500)
@given(
    header=st.one_of(
        st.binary(min_size=0, max_size=12),  # the wrong size too: a SealedRecordError, never struct's
        st.builds(HEADER.pack, st.integers(0, 255), _LENGTHS, _LENGTHS),
    ),
    at=st.sampled_from([(0, 0), (100, 300), (MAX_RECORD_BYTES, MAX_MESSAGE_BYTES)]),
)
def test_a_sealed_header_is_what_a_sender_can_write_next_or_a_sealed_record_error(
    header: bytes, at: tuple[int, int]
) -> None:
    offset, total = at
    fields = HEADER.unpack(header) if len(header) == HEADER.size else (-1, 0, 0)
    valid = len(header) == HEADER.size and _valid_header(*fields, offset, total)
    try:
        parsed = parse_header(memoryview(header), offset, total)
    except SealedRecordError:
        assert not valid
    else:
        assert valid and parsed == fields
