"""One direction of one proxied connection: read into the shared link, deliver each piece on time.

The reader waits for room *before* reading, so the emulator never buffers without bound and TCP flow
control reaches the sender; the writer sleeps until each delivery's time (``shaper.AggregateLink``
computed it) and holds everything while the path is cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable

from nebula_common.wan.shaper import Flow, LinkGate


def set_nodelay(writer: asyncio.StreamWriter) -> None:
    # Nagle would hold back small trailing segments and add latency the emulator did not model.
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def reset(writer: asyncio.StreamWriter) -> None:
    """Abort with RST so the peer sees a broken link, not a clean (and misleading) end of stream."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class Direction:
    """One half of a connection: a reader feeds its flow into the shared link, a writer delivers on time."""

    def __init__(
        self,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        flow: Flow,
        on_delivered: Callable[[int], None],
        gate: LinkGate,
        delay_s: float,
    ) -> None:
        self._src = src
        self._dst = dst
        self._flow = flow
        self._on_delivered = on_delivered
        self._gate = gate
        self._delay_s = delay_s

    async def read_loop(self) -> None:
        while True:
            # Waiting *before* reading leaves data in the kernel, so TCP flow control pushes back
            # on the sender instead of this process buffering without bound.
            await self._flow.wait_room()
            # While the path is cut nothing is read, so the sender's kernel buffers fill up.
            await self._gate.wait_up()
            chunk = await self._src.read(self._flow.read_size())
            # EOF travels the wire behind the data (the shared link orders it after every chunk).
            self._flow.submit(chunk or None)
            if not chunk:
                return

    async def write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        deliveries = self._flow.deliveries
        while True:
            deliver_at, chunk = await deliveries.get()
            while True:
                wait = deliver_at - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if self._gate.up:
                    break
                # Held during a cut: it arrives no earlier than one propagation delay after the restore.
                await self._gate.wait_up()
                deliver_at = max(deliver_at, self._gate.restored_at + self._delay_s)
            if self._dst.is_closing():
                raise ConnectionResetError("peer connection closed while data was in flight")
            if chunk is None:
                if self._dst.can_write_eof():
                    self._dst.write_eof()
                else:
                    self._dst.close()
                return
            self._dst.write(chunk)
            self._on_delivered(len(chunk))
            await self._dst.drain()
            self._flow.written(len(chunk))
