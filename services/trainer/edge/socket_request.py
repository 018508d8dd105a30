"""A stage's request for an edge connection, over its own socketpair with its trainer.

A stage process has no network and holds no token, so it cannot reach the switch's edge socket itself.
It asks its trainer instead: it sends the edge's ``EdgeOpen`` on a ``SOCK_SEQPACKET`` socketpair made
for this alone at its start (the control channel's framing does not carry descriptors); the trainer
checks the open as its proxy checks any (the stage's own job and edges only), obtains a one-time
ticket from the switch, connects, presents the ticket and passes the connected socket back with
``SCM_RIGHTS`` (``services/trainer/stage_edge_fds.py``). A refusal comes back as the status the switch
(or the trainer) gave, so the stage's transport fails or retries exactly as over gRPC.

Wire: a request is an 8-byte request id and the serialized ``EdgeOpen``; a reply is JSON
``{"id", "code", "message"}`` with, when ``code`` is ``OK``, one descriptor attached (and, for a TCP
connection, ``"sealing"``: its sealed records' state, ``RecordSealing.handover``). Replies carry the
id so a reply that arrives after its request timed out is dropped, never taken for the next one's.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import threading

import grpc

from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.rpc.sealed_records import RecordSealing

MAX_REQUEST_BYTES = 4096
"""Largest request a trainer reads (an EdgeOpen is a few dozen bytes)."""
MAX_REPLY_BYTES = 16384
REQUEST_TIMEOUT_S = 60.0
"""How long a stage waits for its trainer's answer (a ticket call and a local connect)."""


class EdgeSocketRefused(Exception):
    """No connection for this open: the status the switch or the trainer gave, and why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def reply(request_id: int, code: grpc.StatusCode, message: str = "", sealing: dict | None = None) -> bytes:
    """A reply packet (the descriptor, for OK, travels beside it, with its sealed records' state on TCP)."""
    answer: dict[str, object] = {"id": request_id, "code": code.name, "message": message}
    if sealing is not None:
        answer["sealing"] = sealing
    return json.dumps(answer).encode()


def parse_request(packet: bytes) -> tuple[int, relay_pb2.EdgeOpen]:
    """(request id, the open); ValueError naming what is wrong."""
    if len(packet) < 8:
        raise ValueError(f"an edge request of {len(packet)} bytes has no request id")
    try:
        return int.from_bytes(packet[:8], "big"), relay_pb2.EdgeOpen.FromString(packet[8:])
    except Exception as exc:  # any protobuf error: not an EdgeOpen
        raise ValueError(f"an edge request that is not an EdgeOpen: {exc}") from None


class EdgeSocketRequester:
    """The stage's side: ``__call__(open)`` returns a connected edge socket or raises EdgeSocketRefused."""

    def __init__(self, sock: socket.socket, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self._sock = sock
        self._timeout_s = timeout_s
        self._lock = threading.Lock()  # one request in flight: a middle stage's two edges take turns
        self._ids = itertools.count(1)

    def __call__(self, open_: relay_pb2.EdgeOpen) -> tuple[socket.socket, RecordSealing | None]:
        with self._lock:
            request_id = next(self._ids)
            try:
                self._sock.settimeout(self._timeout_s)
                self._sock.send(request_id.to_bytes(8, "big") + open_.SerializeToString())
                while True:
                    packet, fds, _, _ = socket.recv_fds(self._sock, MAX_REPLY_BYTES, 1)
                    if not packet:
                        raise EdgeSocketRefused(
                            grpc.StatusCode.UNAVAILABLE, "the trainer closed the stage's edge channel"
                        )
                    answer = json.loads(packet)
                    if answer.get("id") == request_id:
                        break
                    for fd in fds:  # the answer to a request that timed out before
                        with contextlib.suppress(OSError):
                            socket.close(fd)
            except (OSError, ValueError) as exc:
                raise EdgeSocketRefused(
                    grpc.StatusCode.UNAVAILABLE, f"no answer from the trainer for edge {open_.edge!r}: {exc}"
                ) from exc
        code = grpc.StatusCode[str(answer.get("code", "UNKNOWN"))]
        if code != grpc.StatusCode.OK or len(fds) != 1:
            for fd in fds:
                with contextlib.suppress(OSError):
                    socket.close(fd)
            raise EdgeSocketRefused(
                code if code != grpc.StatusCode.OK else grpc.StatusCode.UNKNOWN,
                str(answer.get("message") or "the trainer sent no connection"),
            )
        sock = socket.socket(fileno=fds[0])
        if "sealing" not in answer:
            return sock, None
        try:
            return sock, RecordSealing.resumed(answer["sealing"])
        except ValueError as exc:
            sock.close()
            why = f"the trainer sent an unusable sealing: {exc}"
            raise EdgeSocketRefused(grpc.StatusCode.UNKNOWN, why) from None


__all__ = [
    "MAX_REQUEST_BYTES",
    "EdgeSocketRefused",
    "EdgeSocketRequester",
    "parse_request",
    "reply",
]
