"""TCP forwarder for the network-namespace test: ``LISTEN=TARGET`` pairs, stdlib only (fast to start).

Run inside one organisation's network namespace (``ip netns exec``), it makes that cluster's
loopback-only internal ports reachable on the namespace's *management* address, for the test process
that plays both organisations' operators. It listens on the management interface only, so the peer
organisation (on the WAN veth) still reaches nothing but the switch's WAN port.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _handler(target_host: str, target_port: int) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(target_host, target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    return handle


async def main(pairs: list[str]) -> None:
    servers = []
    for pair in pairs:
        listen, target = pair.split("=")
        host, port = listen.rsplit(":", 1)
        target_host, target_port = target.rsplit(":", 1)
        servers.append(await asyncio.start_server(_handler(target_host, int(target_port)), host, int(port)))
    print("ready", flush=True)
    await asyncio.gather(*(server.serve_forever() for server in servers))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
