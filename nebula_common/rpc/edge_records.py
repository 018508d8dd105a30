"""The wire of an edge carried as records on the switch's edge socket: the parts both ends share.

An edge on the edge socket (``services/switch/edge_socket.py``, the stage's
``services/trainer/edge/records_transport.py``) is a stream of ``4-byte big-endian length + bytes``
records (``raw_records.py``): first the one-time ticket, then the same serialized ``EdgeMessage`` items
and framed chunks an OpenEdge stream carries, both ways. What gRPC's status gives a stream, a final
status record gives this one: the switch's refusal or abort reaches the stage with its code and
message, so it fails or reconnects exactly as it would on gRPC.
"""

from __future__ import annotations

import json

import grpc

from nebula_common.rpc.framing import MAX_CHUNK_BYTES

STATUS_MARK = b"\x00NBSTATUS1"
"""First bytes of a status record (field number 0 is never valid protobuf, so no item starts so)."""
MAX_EDGE_RECORD_BYTES = 2 * MAX_CHUNK_BYTES
"""Largest record on the edge socket: a framed chunk of the largest size with its headers, with room."""


def status_record(code: grpc.StatusCode, message: str) -> bytes:
    """The record that ends an edge on the socket: the status an OpenEdge call would have ended with."""
    return STATUS_MARK + json.dumps({"code": code.name, "message": message}).encode()


def parse_status_record(raw: bytes | memoryview) -> tuple[grpc.StatusCode, str] | None:
    """(code, message) if ``raw`` is a status record, else None (an unreadable one is UNKNOWN)."""
    if bytes(raw[: len(STATUS_MARK)]) != STATUS_MARK:
        return None
    try:
        body = json.loads(bytes(raw[len(STATUS_MARK) :]))
        return grpc.StatusCode[str(body["code"])], str(body["message"])
    except (ValueError, KeyError, TypeError):
        return grpc.StatusCode.UNKNOWN, "the switch sent an unreadable status record"


__all__ = ["MAX_EDGE_RECORD_BYTES", "STATUS_MARK", "parse_status_record", "status_record"]
