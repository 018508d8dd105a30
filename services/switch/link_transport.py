"""What carries a link session: the read/write pair both transports hand it, and their connections.

A session (``PeerLink.run_session`` / ``run_lane``) never sees which transport carries it: a gRPC stream
(``wan_servicer.py``, the dialer's call) or a raw connection (``rawlink.py``) both come down to a
``read`` that returns each message's raw bytes (or ``grpc.aio.EOF``) and a ``write`` that takes them.
The shapes here are what the link modules agree on, so none of them imports a transport.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

import grpc
from cryptography import x509

LINK_METHOD = "/nebula.v1.SwitchLink/Link"
"""The gRPC method of the link, called and served with identity (de)serializers (raw bytes)."""

LINK_WINDOW_BYTES = 1 << 20
"""Fixed HTTP/2 receive window (and raw link send buffer) of a WAN link: it bounds what waits first-in
first-out below the switch's fair scheduler, and caps one link connection at window / RTT (1 MiB:
84 Mbit/s at 100 ms RTT; the link stripes over more connections for more)."""

ReadFn = Callable[[], Awaitable[object]]
WriteFn = Callable[[bytes], Awaitable[None]]
CredentialsFn = Callable[[], grpc.ChannelCredentials]
ProbeFn = Callable[[], Awaitable[x509.Certificate]]


class RawConnectionLike(Protocol):
    """A raw link connection (``rawlink_connection.py``): whole messages both ways, the peer's cert."""

    peer_cert: x509.Certificate | None
    preamble: bytes
    """The preamble exchanged in clear before TLS (``rawlink_connection.PREAMBLE`` or ``PREAMBLE_SEALED``)."""

    async def read(self) -> object: ...

    async def write(self, data: bytes) -> None: ...

    async def close(self) -> None: ...


class Closeable(Protocol):
    async def close(self) -> None: ...


RawDialFn = Callable[[], Awaitable[RawConnectionLike]]
LaneOpenFn = Callable[[int], Awaitable[tuple[Closeable, "asyncio.Task[None]"]]]


def grpc_writer(write: WriteFn) -> WriteFn:
    """``write`` of a gRPC call, taking the views a raw transport hands on too (gRPC wants bytes)."""

    async def write_bytes(data: bytes) -> None:
        await write(data if isinstance(data, bytes) else bytes(data))

    return write_bytes
