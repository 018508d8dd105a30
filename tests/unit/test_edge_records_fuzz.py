"""Fuzzing the edge socket's parsers: whatever a peer sends, a valid result or the documented error.

* the switch's final status record (``nebula_common/rpc/edge_records.py``: ``parse_status_record``) ->
  None for anything that is not one, (code, message) otherwise, an unreadable one UNKNOWN;
* a stage's edge request (``services/trainer/edge/socket_request.py``: ``parse_request``) -> (id, open)
  or ValueError;
* the stage's record readers (``services/trainer/edge/record_io.py``) on a real socket: a record, the
  end, or their documented errors (a plain record over ``MAX_EDGE_RECORD_BYTES`` fails the edge before
  any buffer is sized from it; a sealed one that fails authentication is SealedRecordError);
* the sealed records' state a trainer hands its stage (``RecordSealing.resumed``): a sealing or
  ValueError naming what is wrong.
"""

from __future__ import annotations

import json
import socket
import threading

import grpc
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.rpc.edge_records import (
    MAX_EDGE_RECORD_BYTES,
    STATUS_MARK,
    parse_status_record,
    status_record,
)
from nebula_common.rpc.framing import FramedChunk, encode_chunk
from nebula_common.rpc.sealed_records import RecordSealing, SealedRecordError, sealed_size
from services.trainer.edge.record_io import Ended, PlainRecords, SealedRecords, TooLarge
from services.trainer.edge.socket_request import parse_request

pytestmark = pytest.mark.timeout(120)


@given(st.binary(max_size=300))
@example(STATUS_MARK)
@example(STATUS_MARK + b"{}")
@example(STATUS_MARK + json.dumps({"code": "NO_SUCH", "message": 1}).encode())
@settings(max_examples=300, deadline=None)
def test_status_records_parse_or_are_not_ones(raw: bytes) -> None:
    parsed = parse_status_record(raw)
    if not raw.startswith(STATUS_MARK):
        assert parsed is None
    else:
        assert parsed is not None and isinstance(parsed[0], grpc.StatusCode) and isinstance(parsed[1], str)


@given(st.sampled_from(list(grpc.StatusCode)), st.text(max_size=200))
def test_a_status_record_round_trips(code: grpc.StatusCode, message: str) -> None:
    assert parse_status_record(status_record(code, message)) == (code, message)
    assert parse_status_record(memoryview(status_record(code, message))) == (code, message)


@given(st.binary(max_size=200))
@example(b"")
@example(b"\0" * 8 + relay_pb2.EdgeOpen(job_id="j", edge="e").SerializeToString())
@settings(max_examples=300, deadline=None)
def test_edge_requests_parse_or_are_refused(raw: bytes) -> None:
    try:
        request_id, opened = parse_request(raw)
    except ValueError as exc:
        assert "edge request" in str(exc)
        return
    assert 0 <= request_id < 1 << 64 and isinstance(opened, relay_pb2.EdgeOpen)


@given(st.lists(st.binary(max_size=2000), max_size=4), st.binary(max_size=8))
@settings(max_examples=100, deadline=None)
def test_the_stage_reader_reads_records_or_fails_as_documented(records: list[bytes], tail: bytes) -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b"".join(len(r).to_bytes(4, "big") + r for r in records) + tail)
        theirs.shutdown(socket.SHUT_WR)
        reader = PlainRecords(ours)
        got: list[bytes] = []
        try:
            while (record := reader.read()) is not None:
                got.append(bytes(record))
        except (Ended, TooLarge):
            assert tail, "well-formed records ended in an error"
            return
        assert got[: len(records)] == records


def test_the_stage_reader_places_the_expected_chunks_payload_and_reads_any_other_whole() -> None:
    payload = bytes(range(256)) * 1200  # 300 KiB: above the reader's small-record size
    expected, _ = encode_chunk("j", "e", 0, 3, 0, memoryview(payload), True)
    declined, _ = encode_chunk("j", "e", 0, 4, 0, memoryview(payload), True)
    unparsable = expected[:-1]  # framed, but one byte short of what it declares
    frame = bytearray(len(payload))
    asked: list[tuple[int, int]] = []

    def placer(chunk: FramedChunk, size: int) -> tuple[object, memoryview] | None:
        asked.append((chunk.frame_id, size))
        if chunk.frame_id != 3:
            return None
        return "frame 3", memoryview(frame)[chunk.offset : chunk.offset + size]

    ours, theirs = socket.socketpair()
    with ours, theirs:
        writer = PlainRecords(theirs)
        sender = threading.Thread(
            target=lambda: [writer.send(r) for r in (expected, declined, unparsable)], daemon=True
        )
        sender.start()
        reader = PlainRecords(ours, placer=placer)
        first = reader.read()
        assert isinstance(first, FramedChunk) and first.placed == "frame 3" and first.data.obj is frame
        assert bytes(frame) == payload and reader.placed_bytes == len(payload)
        second, third = reader.read(), reader.read()
        assert not isinstance(second, FramedChunk) and bytes(second) == declined
        assert not isinstance(third, FramedChunk) and bytes(third) == unparsable
        assert asked == [(3, len(payload)), (4, len(payload))]  # the unparsable one is never offered
        sender.join(10)


def test_the_stage_reader_refuses_a_record_over_the_bound_before_reading_it() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall((MAX_EDGE_RECORD_BYTES + 1).to_bytes(4, "big"))
        with pytest.raises(TooLarge, match="limit"):
            PlainRecords(ours).read()


SECRETS = (bytes(range(32)), bytes(range(32, 64)))


def _sealed(messages: list[bytes], close: bool, record_bytes: int) -> bytes:
    sender = RecordSealing(SECRETS[0], SECRETS[1], record_bytes=record_bytes)
    out = bytearray()
    for message in messages:
        buffer = bytearray(sealed_size(len(message), record_bytes))
        out += buffer[: sender.seal_into(message, memoryview(buffer))]
    if close:
        buffer = bytearray(sealed_size(0))
        out += buffer[: sender.seal_close_into(memoryview(buffer))]
    return bytes(out)


@given(
    st.lists(st.binary(max_size=3000), max_size=4),
    st.booleans(),
    st.sampled_from([64, 1000, 1 << 20]),
    st.integers(min_value=-1, max_value=40000),
    st.integers(min_value=0, max_value=255),
)
@settings(max_examples=150, deadline=None)
def test_the_sealed_reader_reads_messages_or_fails_as_documented(
    messages: list[bytes], close: bool, record_bytes: int, flip_at: int, flip: int
) -> None:
    """Sealed records as a switch sends them, whole or with one byte changed or cut short: the messages
    in order and None after the close, or Ended (cut) / SealedRecordError (changed) before any of a
    broken record's bytes are handed on."""
    wire = bytearray(_sealed(messages, close, record_bytes))
    changed = 0 <= flip_at < len(wire) and flip != 0
    if changed:
        wire[flip_at] ^= flip
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(wire)
        theirs.shutdown(socket.SHUT_WR)
        reader = SealedRecords(ours, RecordSealing(SECRETS[1], SECRETS[0]))
        got: list[bytes] = []
        try:
            while (message := reader.read()) is not None:
                got.append(bytes(message))
        except (Ended, SealedRecordError):
            assert changed or not close, "well-formed sealed records ended in an error"
            assert got == messages[: len(got)]
            return
        assert close and got == messages


@given(
    st.dictionaries(
        st.sampled_from(["send", "receive", "sent", "sent_bytes", "opened", "opened_bytes", "record_bytes"]),
        st.one_of(st.integers(min_value=-5, max_value=1 << 40), st.text(max_size=70), st.none()),
    )
)
@example(
    {
        "send": "00" * 32,
        "receive": "11" * 32,
        "sent": 1,
        "sent_bytes": 32,
        "opened": 0,
        "opened_bytes": 0,
        "record_bytes": 1 << 20,
    }
)
@settings(max_examples=300, deadline=None)
def test_a_sealing_handover_resumes_or_is_refused(state: dict) -> None:
    try:
        sealing = RecordSealing.resumed(state)
    except ValueError:
        return
    assert isinstance(sealing, RecordSealing)


def test_a_resumed_sealing_continues_where_the_trainer_stopped() -> None:
    """The trainer seals the ticket, hands over; the stage's next record opens at the switch."""
    trainer = RecordSealing(SECRETS[0], SECRETS[1])
    switch = RecordSealing(SECRETS[1], SECRETS[0])
    ours, theirs = socket.socketpair()
    with ours, theirs:
        reader = SealedRecords(ours, switch)
        for step in ("ticket", "stage"):  # the trainer's ticket, then the stage's first record
            sender = trainer if step == "ticket" else RecordSealing.resumed(trainer.handover())
            buffer = bytearray(sealed_size(5))
            theirs.sendall(buffer[: sender.seal_into(b"hello", memoryview(buffer))])
            assert reader.read() == b"hello"
        again = bytearray(sealed_size(5))  # a record sealed under the handed-over number twice fails
        theirs.sendall(
            again[: RecordSealing.resumed(trainer.handover()).seal_into(b"hello", memoryview(again))]
        )
        with pytest.raises(SealedRecordError):
            reader.read()


STALL_S = 0.5


Reader = PlainRecords | SealedRecords


def _stall_reader(sock: socket.socket, sealed: bool, payload: bytes) -> tuple[Reader, bytes]:
    """A stage's reader with the short stall bound, and ``payload`` as its switch would send it."""
    if sealed:
        sealing = RecordSealing(SECRETS[1], SECRETS[0])
        return SealedRecords(sock, sealing, stall_s=STALL_S), _sealed([payload], False, 1 << 20)
    return PlainRecords(sock, stall_s=STALL_S), len(payload).to_bytes(4, "big") + payload


@pytest.mark.parametrize("sealed", [False, True])
def test_a_record_that_stalls_midway_ends_the_connection(sealed: bool) -> None:
    """Half a record, then nothing: the stage's reader gives up after its stall bound, naming why."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        reader, wire = _stall_reader(ours, sealed, b"x" * 5000)
        theirs.sendall(wire[: len(wire) // 2])
        with pytest.raises(Ended, match=r"no byte of an unfinished record for 0\.5 s"):
            reader.read()


@pytest.mark.parametrize("sealed", [False, True])
def test_an_edge_silent_between_records_waits_without_a_bound(sealed: bool) -> None:
    """Stages may compute for long between messages: no stall bound applies between records."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        reader, wire = _stall_reader(ours, sealed, b"y" * 3000)
        got: list[object] = []
        thread = threading.Thread(target=lambda: got.append(reader.read()), daemon=True)
        thread.start()
        thread.join(4 * STALL_S)
        assert thread.is_alive() and not got, f"the reader gave up on a silent edge: {got}"
        theirs.sendall(wire)
        thread.join(30)
        assert not thread.is_alive(), "the reader did not return the record sent after the silence"
        assert got and bytes(got[0]) == (b"y" * 3000)  # type: ignore[arg-type]
