"""A hostile switch for the trainer's edge ends: a Relay/OpenEdge server that sends bytes that do not parse.

``hostile_relay(garbage)`` serves it on a local port with raw-bytes (identity) serializers, so it can
send anything; ``started_threads`` tells what a test's trainer end left running.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc

from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.rpc.framing import LINK_FRAMING_VERSION, encode_chunk

OPEN_EDGE = "/nebula.v1.Relay/OpenEdge"
POOL = "hostile-relay"
"""Name prefix of the hostile switch's server threads (``started_threads`` leaves them out)."""

NOT_AN_EDGE_MESSAGE = b"\x0a\x05\xff\xff"
"""Field 1 (``open``) declares 5 bytes and 2 follow: protobuf's DecodeError."""
_VALID_CHUNK, _ = encode_chunk("job", "e", 0, 1, 0, b"x" * 64, True)
CORRUPT_CHUNK = _VALID_CHUNK[:2] + b"\x02" + _VALID_CHUNK[3:]
"""A framed chunk whose header's first key (``job_id``) became field 0: a FramingError."""


class HostileRelay(grpc.GenericRpcHandler):
    """Answers every open with a valid ready (unless ``ready`` is false), then sends ``garbage`` and
    holds the stream open: only the trainer's end can end it."""

    def __init__(self, garbage: bytes, ready: bool) -> None:
        self.garbage = garbage
        self.ready = ready
        self.lock = threading.Lock()
        self.opens: list[relay_pb2.EdgeOpen] = []
        self.ended = 0
        """Calls that ended (the trainer's end cancelled them)."""

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if details.method != OPEN_EDGE:
            return None
        return grpc.stream_stream_rpc_method_handler(self.open_edge)

    def _ended(self) -> None:
        with self.lock:
            self.ended += 1

    def open_edge(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        first = relay_pb2.EdgeMessage.FromString(next(requests))
        with self.lock:
            self.opens.append(first.open)
        context.add_callback(self._ended)
        if self.ready:
            ready = relay_pb2.EdgeReady(
                max_window_bytes=1 << 20, link_up=True, link_framing=LINK_FRAMING_VERSION
            )
            yield relay_pb2.EdgeMessage(ready=ready).SerializeToString()
        yield self.garbage
        try:
            for _ in requests:
                pass
        except grpc.RpcError:  # cancelled by the trainer's end
            pass


@contextmanager
def hostile_relay(garbage: bytes, ready: bool = True) -> Iterator[tuple[HostileRelay, str]]:
    """A hostile switch sending ``garbage`` (after a ready, if ``ready``); yields it and its address."""
    relay = HostileRelay(garbage, ready)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix=POOL), handlers=[relay])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield relay, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def started_threads(before: set[threading.Thread], *ignored: str) -> list[str]:
    """Names of the threads started since ``before`` and still alive, but the hostile switch's and
    those whose name starts with one of ``ignored``."""
    return [
        t.name
        for t in threading.enumerate()
        if t not in before and t.is_alive() and not t.name.startswith((POOL, *ignored))
    ]
