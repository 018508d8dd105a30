"""Relaying a gRPC peer's TLS bytes through the WAN frontend without copying them through Python.

The frontend (``wan_frontend.WanFrontend``) owns the WAN port so that it can give every source address a few
slots (``source_limits.py``); a gRPC peer's connection is then relayed, encrypted and untouched, to the
gRPC WAN server on loopback. Copying those bytes through Python buffers doubled the accepting switch's CPU
per relayed GB; ``os.splice`` moves them socket -> pipe -> socket inside the kernel instead, driven by the
event loop's readiness callbacks (one wake-up per up to ``PIPE_BYTES``). Where ``os.splice`` is missing
(not Linux) the bytes go through ``sock_recv_into`` and ``sock_sendall`` on one reused buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket

PIPE_BYTES = 1 << 20
"""Bytes one splice moves at most (and the pipe's capacity where the kernel allows it)."""


async def _ready(loop: asyncio.AbstractEventLoop, fd: int, *, writable: bool) -> None:
    future = loop.create_future()
    add, remove = (loop.add_writer, loop.remove_writer) if writable else (loop.add_reader, loop.remove_reader)
    add(fd, lambda: future.done() or future.set_result(None))
    try:
        await future
    finally:
        remove(fd)


async def _splice(source: socket.socket, sink: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    with contextlib.suppress(OSError, AttributeError):
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    flags = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
    try:
        while True:
            try:
                moved = os.splice(source.fileno(), write_end, PIPE_BYTES, flags=flags)
            except BlockingIOError:
                await _ready(loop, source.fileno(), writable=False)
                continue
            if moved == 0:
                return
            while moved:
                try:
                    moved -= os.splice(read_end, sink.fileno(), moved, flags=flags)
                except BlockingIOError:
                    await _ready(loop, sink.fileno(), writable=True)
    finally:
        os.close(read_end)
        os.close(write_end)


async def _copy(source: socket.socket, sink: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    buffer = bytearray(PIPE_BYTES)
    view = memoryview(buffer)
    while received := await loop.sock_recv_into(source, buffer):
        await loop.sock_sendall(sink, view[:received])


async def pump(source: socket.socket, sink: socket.socket) -> None:
    """Move ``source``'s bytes to ``sink`` until ``source`` ends, then end ``sink``'s writing side.

    Both sockets must be non-blocking; errors (a reset) end the pump by raising ``OSError``.
    """
    try:
        await (_splice if hasattr(os, "splice") else _copy)(source, sink)
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


async def relay(client: socket.socket, backend_address: str) -> None:
    """Relay ``client`` (non-blocking) to a new connection to ``backend_address`` and back, until both end."""
    loop = asyncio.get_running_loop()
    host, _, port = backend_address.rpartition(":")
    backend = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        backend.setblocking(False)
        await loop.sock_connect(backend, (host, int(port)))
        for sock in (client, backend):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tasks = {asyncio.create_task(pump(client, backend)), asyncio.create_task(pump(backend, client))}
        try:
            # A clean end of one direction leaves the other running (TLS close_notify, then the end);
            # a failed one (a reset) ends both.
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
    finally:
        backend.close()
        client.close()
