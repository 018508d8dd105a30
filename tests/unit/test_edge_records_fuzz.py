"""Fuzzing the edge socket's parsers: whatever a peer sends, a valid result or the documented error.

* the switch's final status record (``nebula_common/rpc/edge_records.py``: ``parse_status_record``) ->
  None for anything that is not one, (code, message) otherwise, an unreadable one UNKNOWN;
* a stage's edge request (``services/trainer/edge/socket_request.py``: ``parse_request``) -> (id, open)
  or ValueError;
* the stage's record reader (``services/trainer/edge/records_transport.py``) on a real socket: a record,
  the end, or its documented errors (a record over ``MAX_EDGE_RECORD_BYTES`` fails the edge before any
  buffer is sized from it).
"""

from __future__ import annotations

import json
import socket

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
from services.trainer.edge.reconnecting import EdgeFailed
from services.trainer.edge.records_transport import _Ended, _Reader
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
        reader = _Reader(ours)
        got: list[bytes] = []
        try:
            while (record := reader.read()) is not None:
                got.append(bytes(record))
        except (_Ended, EdgeFailed):
            assert tail, "well-formed records ended in an error"
            return
        assert got[: len(records)] == records


def test_the_stage_reader_refuses_a_record_over_the_bound_before_reading_it() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall((MAX_EDGE_RECORD_BYTES + 1).to_bytes(4, "big"))
        with pytest.raises(EdgeFailed, match="limit"):
            _Reader(ours).read()
