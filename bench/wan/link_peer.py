"""The two ends of the emulator-vs-kernel benchmark, each run inside its own network namespace.

``serve`` (namespace b) runs, in one process: a sink on b's loopback, the WAN emulator shaped as
asked (``emulator`` port), and a *delay-only* proxy (``reference`` port: the same emulator code with a
bandwidth far above the link's, so it adds the one-way delay and nothing else). It prints one JSON
line with the ports, then serves until stdin closes.

``send`` (namespace a) opens ``--connections`` TCP connections to one of those ports, sends
``--bytes`` spread over them, half-closes, and waits for the sink to confirm every byte; it prints
one JSON line with the elapsed time. The clock starts before the first connect and stops at the last
confirmation, so both arms pay the same handshake, the same one-way delay for the data and the same
one-way delay back for the confirmation.

Arms (``bench/wan/link.py`` alternates them):

- kernel:   a --veth, tc tbf on a's egress--> delay proxy (b) --> sink (b)
- emulator: a --veth, no qdisc------------> emulator (b)    --> sink (b)

Only standard library and ``nebula_common.wan`` are imported (no torch), so each run starts fast.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import struct
import sys
import time

from nebula_common.wan import LinkShape, WanEmulator

_HEADER = struct.Struct("!Q")
# The delay-only proxy's bandwidth: far above any link measured, so its serialization is negligible.
_UNSHAPED_MBIT = 1_000_000.0
_BLOCK = 1 << 20


async def _sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    received = 0
    while chunk := await reader.read(1 << 18):
        received += len(chunk)
    writer.write(_HEADER.pack(received))
    with contextlib.suppress(ConnectionError):
        await writer.drain()
    writer.close()


async def serve(listen_host: str, shape: LinkShape) -> None:
    sink = await asyncio.start_server(_sink, "127.0.0.1", 0)
    sink_port = sink.sockets[0].getsockname()[1]
    # Only bandwidth and delay: a baseline checkout's older LinkShape must accept the same call.
    delay_only = LinkShape(bandwidth_mbit=_UNSHAPED_MBIT, delay_ms=shape.delay_ms)
    async with (
        WanEmulator("127.0.0.1", sink_port, shape, listen_host, 0) as emulator,
        WanEmulator("127.0.0.1", sink_port, delay_only, listen_host, 0) as reference,
    ):
        print(
            json.dumps({"emulator": emulator.port, "reference": reference.port, "sink": sink_port}),
            flush=True,
        )
        loop = asyncio.get_running_loop()
        # Serve until the parent closes our stdin (or dies): no signals, no orphans.
        await loop.run_in_executor(None, sys.stdin.read)
        print(json.dumps({"status": emulator.status()}), flush=True)
    sink.close()
    await sink.wait_closed()


async def _send_one(host: str, port: int, size: int) -> int:
    reader, writer = await asyncio.open_connection(host, port)
    block = bytes(_BLOCK)
    view = memoryview(block)
    left = size
    while left > 0:
        n = min(left, _BLOCK)
        writer.write(view[:n])
        await writer.drain()
        left -= n
    writer.write_eof()
    (confirmed,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    writer.close()
    return int(confirmed)


async def send(host: str, port: int, total: int, connections: int) -> dict[str, float | int]:
    sizes = [total // connections + (1 if i < total % connections else 0) for i in range(connections)]
    started = time.perf_counter()
    confirmed = await asyncio.gather(*(_send_one(host, port, size) for size in sizes))
    elapsed = time.perf_counter() - started
    if list(confirmed) != sizes:
        raise RuntimeError(f"sink confirmed {confirmed} bytes, sent {sizes}")
    return {"elapsed_s": elapsed, "bytes": total, "connections": connections}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="mode", required=True)
    srv = sub.add_parser("serve")
    srv.add_argument("--listen-host", required=True)
    srv.add_argument("--bandwidth-mbit", type=float, required=True)
    srv.add_argument("--delay-ms", type=float, required=True)
    snd = sub.add_parser("send")
    snd.add_argument("--host", required=True)
    snd.add_argument("--port", type=int, required=True)
    snd.add_argument("--bytes", type=int, required=True)
    snd.add_argument("--connections", type=int, default=1)
    args = parser.parse_args(argv)
    if args.mode == "serve":
        shape = LinkShape(bandwidth_mbit=args.bandwidth_mbit, delay_ms=args.delay_ms)
        asyncio.run(serve(args.listen_host, shape))
    else:
        print(json.dumps(asyncio.run(send(args.host, args.port, args.bytes, args.connections))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
