"""The link half of a modelled step: a row's real frames through the WAN emulator between two sockets.

A step's frames (forward there, the gradient back) cross ``nebula_common.wan.WanEmulator`` at the run's
shape; the median of several exchanges, the first (which opens the path) left out.
"""

from __future__ import annotations

import asyncio
import statistics
import time

from nebula_common.wan import LinkShape, WanEmulator


async def _link_seconds(shape: LinkShape, forward: bytes, backward: bytes, repeats: int) -> list[float]:
    """Seconds per (forward frame there, backward frame back) through a real emulated link."""

    done = asyncio.Event()

    async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while size := int.from_bytes(await reader.readexactly(4), "big"):  # 0: the sender is done
                await reader.readexactly(size)
                writer.write(len(backward).to_bytes(4, "big") + backward)
                await writer.drain()
        finally:
            writer.close()
            done.set()

    server = await asyncio.start_server(peer, "127.0.0.1", 0)
    try:
        target = server.sockets[0].getsockname()[1]
        async with WanEmulator("127.0.0.1", target, shape) as emulator:
            reader, writer = await asyncio.open_connection("127.0.0.1", emulator.port)
            times = []
            for attempt in range(repeats + 1):  # the first exchange opens the path; not counted
                started = time.perf_counter()
                writer.write(len(forward).to_bytes(4, "big") + forward)
                await writer.drain()
                size = int.from_bytes(await asyncio.wait_for(reader.readexactly(4), 120), "big")
                await asyncio.wait_for(reader.readexactly(size), 120)
                if attempt:
                    times.append(time.perf_counter() - started)
            writer.write((0).to_bytes(4, "big"))
            await writer.drain()
            await asyncio.wait_for(done.wait(), 60)  # the peer has read the end marker and closed
            writer.close()
            return times
    finally:
        server.close()
        await server.wait_closed()


def link_seconds(shape: LinkShape, forward: bytes, backward: bytes, repeats: int) -> float:
    """The median seconds of ``repeats`` exchanges of the two frames."""
    return statistics.median(asyncio.run(_link_seconds(shape, forward, backward, repeats)))
