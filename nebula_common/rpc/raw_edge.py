"""Wire constants of the raw edge transport (``services/switch/raw_edge.py``): switch and trainer."""

from __future__ import annotations

import json

import grpc

RAW_EDGE_VERSION = 1
"""Value of ``EdgeOpen.raw_edge`` a trainer that speaks the raw edge sends."""
ERROR_MARK = b"\x00NBERR"
"""First bytes of the error record a refused raw edge gets (field number 0 is never valid protobuf)."""


def error_record(code: grpc.StatusCode, details: str) -> bytes:
    """The record that ends a refused raw edge: the status a gRPC call would have ended with."""
    return ERROR_MARK + json.dumps({"code": code.name, "details": details}).encode()


def parse_error_record(raw: bytes | memoryview) -> tuple[str, str] | None:
    """(status code name, details) if ``raw`` is an error record, else None."""
    if bytes(raw[: len(ERROR_MARK)]) != ERROR_MARK:
        return None
    try:
        body = json.loads(bytes(raw[len(ERROR_MARK) :]))
        return str(body["code"]), str(body["details"])
    except (ValueError, KeyError, TypeError):
        return "UNKNOWN", "the switch sent an unreadable error record"


__all__ = ["ERROR_MARK", "RAW_EDGE_VERSION", "error_record", "parse_error_record"]
