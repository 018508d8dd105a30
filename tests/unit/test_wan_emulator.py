"""WAN emulator tests over real loopback sockets, because shaping accuracy is a timing property."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from nebula_common.cli.wan import app
from nebula_common.wan import LinkShape, WanEmulator
from nebula_common.wan.address import parse_address

REPO_ROOT = Path(__file__).resolve().parents[2]

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def run(coro: Coroutine[Any, Any, None]) -> None:
    """asyncio.run that also fails the test on anything the loop would only have logged."""
    problems: list[dict[str, Any]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, context: problems.append(context))
        await coro
        leftover = [t for t in asyncio.all_tasks() if t.get_name().startswith("wan-")]
        assert not leftover, f"emulator tasks left running: {leftover}"

    asyncio.run(main())
    assert not problems, f"event loop reported: {problems}"


@contextlib.asynccontextmanager
async def serve(handler: Handler, port: int = 0) -> Any:
    """Local target server whose handler tasks are cancelled on exit, so no test leaks tasks."""
    tasks: set[asyncio.Task[None]] = set()

    def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def wrapped() -> None:
            try:
                with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                    await handler(reader, writer)
            finally:
                writer.close()

        task = asyncio.get_running_loop().create_task(wrapped())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    server = await asyncio.start_server(on_client, "127.0.0.1", port)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def assert_paced(measured: float, ideal: float, label: str) -> None:
    """Never faster than the link (the token bucket lends at most one burst), and really paced at it.

    Accuracy is measured by the benchmark (``make bench-wan-link``), not here: on a loaded machine
    lateness only adds, so the late side gets a generous bound and the early side a tight one.
    """
    early_slack = BULK_SHAPE.burst_bytes * 8 / BULK_SHAPE.bits_per_second
    error = (measured - ideal) / ideal
    print(f"{label}: measured {measured * 1000:.1f} ms, ideal {ideal * 1000:.1f} ms, error {error:+.2%}")
    assert measured >= ideal - early_slack, f"{label}: {measured:.4f}s beats the link's {ideal:.4f}s"
    assert measured <= 1.5 * ideal, f"{label}: {measured:.4f}s vs ideal {ideal:.4f}s ({error:+.2%})"


BULK_BYTES = 3_000_000
BULK_SHAPE = LinkShape(bandwidth_mbit=24.0, delay_ms=20.0)
# The bandwidth is a wire rate: 66 header bytes per 1448-byte segment travel with the payload.
BULK_IDEAL_S = BULK_SHAPE.wire_bytes(BULK_BYTES) * 8 / BULK_SHAPE.bits_per_second + BULK_SHAPE.delay_s


@pytest.mark.timeout(60)
def test_bulk_upstream_matches_bandwidth_and_delay() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        payload = os.urandom(BULK_BYTES)

        async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            received = 0
            while chunk := await reader.read(1 << 16):
                received += len(chunk)
                if received == BULK_BYTES:
                    done.set_result(loop.time())
            writer.write(b"ok")
            await writer.drain()

        async with serve(sink) as target_port, WanEmulator("127.0.0.1", target_port, BULK_SHAPE) as emu:
            reader, writer = await asyncio.open_connection("127.0.0.1", emu.port)
            started = loop.time()
            writer.write(payload)
            await writer.drain()
            writer.write_eof()
            finished = await done
            assert await reader.read() == b"ok"
            writer.close()
            assert_paced(finished - started, BULK_IDEAL_S, "upstream 3 MB @ 24 Mbit/s + 20 ms")

    run(body())


@pytest.mark.timeout(60)
def test_bulk_downstream_matches_bandwidth_and_delay() -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        started = loop.create_future()
        payload = os.urandom(BULK_BYTES)

        async def source(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            started.set_result(loop.time())
            writer.write(payload)
            await writer.drain()
            writer.write_eof()
            await reader.read()

        async with serve(source) as target_port, WanEmulator("127.0.0.1", target_port, BULK_SHAPE) as emu:
            reader, writer = await asyncio.open_connection("127.0.0.1", emu.port)
            received = 0
            while chunk := await reader.read(1 << 16):
                received += len(chunk)
                if received == BULK_BYTES:
                    finished = loop.time()
            writer.close()
            assert received == BULK_BYTES
            assert_paced(finished - await started, BULK_IDEAL_S, "downstream 3 MB @ 24 Mbit/s + 20 ms")

    run(body())


@pytest.mark.timeout(60)
def test_small_message_latency_is_the_one_way_delay_in_each_direction() -> None:
    shape = LinkShape(bandwidth_mbit=100.0, delay_ms=40.0)
    delay = shape.delay_ms / 1000

    async def body() -> None:
        loop = asyncio.get_running_loop()
        up_arrivals: asyncio.Queue[float] = asyncio.Queue()
        down_sends: asyncio.Queue[float] = asyncio.Queue()

        async def target(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            # Each 64-byte ping is timestamped on arrival, then a pong is sent straight back.
            while data := await reader.readexactly(64):
                await up_arrivals.put(loop.time())
                down_sends.put_nowait(loop.time())
                writer.write(data)
                await writer.drain()

        latencies: list[float] = []
        async with serve(target) as target_port, WanEmulator("127.0.0.1", target_port, shape) as emu:
            reader, writer = await asyncio.open_connection("127.0.0.1", emu.port)
            for i in range(4):
                sent = loop.time()
                writer.write(bytes([i]) * 64)
                await writer.drain()
                assert await reader.readexactly(64) == bytes([i]) * 64
                received = loop.time()
                up = await up_arrivals.get() - sent
                down = received - await down_sends.get()
                print(f"ping {i}: up {up * 1000:.2f} ms, down {down * 1000:.2f} ms")
                latencies += [up, down]
            writer.close()
        # Never early. Lateness on a loaded machine only adds, so the bound on the late side is on the
        # best of eight samples: at least one crossed in about the configured delay.
        assert min(latencies) >= delay - 0.001, latencies
        assert min(latencies) <= delay + 0.010, latencies

    run(body())


@pytest.mark.timeout(60)
def test_counters_and_half_close_keep_data_intact() -> None:
    up_bytes = 700_001
    down_bytes = 123_457
    shape = LinkShape(bandwidth_mbit=400.0, delay_ms=5.0)

    async def body() -> None:
        loop = asyncio.get_running_loop()
        payload = os.urandom(up_bytes)
        reply = os.urandom(down_bytes)
        eof_seen_after = loop.create_future()

        async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            # read() returns only at EOF, so the digest proves EOF came after every byte.
            data = await reader.read()
            eof_seen_after.set_result(len(data))
            writer.write(hashlib.sha256(data).digest() + reply)
            await writer.drain()

        async with serve(sink) as target_port, WanEmulator("127.0.0.1", target_port, shape) as emu:
            reader, writer = await asyncio.open_connection("127.0.0.1", emu.port)
            writer.write(payload)
            await writer.drain()
            writer.write_eof()
            # The client can still read after shutting down its write side.
            answer = await reader.read()
            writer.close()
            assert await eof_seen_after == up_bytes
            assert answer[:32] == hashlib.sha256(payload).digest()
            assert answer[32:] == reply
            assert emu.bytes_upstream == up_bytes
            assert emu.bytes_downstream == 32 + down_bytes
            assert emu.connections_total == 1

    run(body())


@pytest.mark.timeout(60)
def test_unreachable_target_closes_client_and_later_connections_work(
    caplog: pytest.LogCaptureFixture,
) -> None:
    shape = LinkShape(bandwidth_mbit=100.0, delay_ms=1.0)

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(4096):
            writer.write(data)
            await writer.drain()

    async def body() -> None:
        loop = asyncio.get_running_loop()
        target_port = free_port()
        async with WanEmulator("127.0.0.1", target_port, shape) as emu:
            reader, writer = await asyncio.open_connection("127.0.0.1", emu.port)
            writer.write(b"anyone there?")
            started = loop.time()
            with contextlib.suppress(ConnectionError):
                assert await asyncio.wait_for(reader.read(), 10.0) == b""
            # Refused at once, not after the emulator's 10 s connect timeout.
            assert loop.time() - started < 5.0
            writer.close()

            async with serve(echo, port=target_port):
                reader, writer = await asyncio.open_connection("127.0.0.1", emu.port)
                writer.write(b"hello")
                assert await asyncio.wait_for(reader.readexactly(5), 2.0) == b"hello"
                writer.close()
            assert emu.connections_total == 2

    with caplog.at_level(logging.WARNING, logger="nebula_common.wan.emulator"):
        run(body())
    assert any("cannot reach target" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(60)
def test_client_reset_resets_target_side() -> None:
    shape = LinkShape(bandwidth_mbit=100.0, delay_ms=5.0)

    async def body() -> None:
        outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        arrived = asyncio.Event()

        async def target(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readexactly(3)
            arrived.set()
            try:
                rest = await reader.read()
                outcome.set_result(f"eof after {len(rest)} bytes")
            except ConnectionResetError:
                outcome.set_result("reset")

        async with serve(target) as target_port, WanEmulator("127.0.0.1", target_port, shape) as emu:
            _reader, writer = await asyncio.open_connection("127.0.0.1", emu.port)
            writer.write(b"abc")
            # The reset must reach a target that is already reading, however late the loop runs.
            await asyncio.wait_for(arrived.wait(), 10.0)
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            assert await asyncio.wait_for(outcome, 10.0) == "reset"

    run(body())


@pytest.mark.timeout(60)
def test_stop_tears_down_live_connections_promptly() -> None:
    shape = LinkShape(bandwidth_mbit=1.0, delay_ms=500.0)

    async def body() -> None:
        loop = asyncio.get_running_loop()

        async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read()

        async with serve(sink) as target_port:
            emu = WanEmulator("127.0.0.1", target_port, shape)
            port = await emu.start()
            assert port == emu.port != 0
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(os.urandom(1_000_000))  # far more than the link can carry before stop()
            deadline = loop.time() + 10
            while emu.connections_open < 1:
                assert loop.time() < deadline, "the emulator never carried the connection"
                await asyncio.sleep(0.01)
            started = loop.time()
            await emu.stop()
            # The link would need 8 s for what it holds: stop() aborts instead of draining.
            assert loop.time() - started < 4.0
            with contextlib.suppress(ConnectionError):
                assert await asyncio.wait_for(reader.read(), 2.0) == b""
            writer.transport.abort()
            with pytest.raises(OSError):
                await asyncio.open_connection("127.0.0.1", port)
            await emu.stop()  # idempotent

    run(body())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"bandwidth_mbit": 0, "delay_ms": 10}, "bandwidth_mbit"),
        ({"bandwidth_mbit": -5, "delay_ms": 10}, "bandwidth_mbit"),
        ({"bandwidth_mbit": float("inf"), "delay_ms": 10}, "bandwidth_mbit"),
        ({"bandwidth_mbit": float("nan"), "delay_ms": 10}, "bandwidth_mbit"),
        ({"bandwidth_mbit": "60", "delay_ms": 10}, "bandwidth_mbit"),
        ({"bandwidth_mbit": 60, "delay_ms": -1}, "delay_ms"),
        ({"bandwidth_mbit": 60, "delay_ms": float("inf")}, "delay_ms"),
        ({"bandwidth_mbit": 60, "delay_ms": True}, "delay_ms"),
    ],
)
def test_link_shape_validation_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LinkShape(**kwargs)


def test_link_shape_accepts_zero_delay() -> None:
    assert LinkShape(bandwidth_mbit=0.5, delay_ms=0).delay_s == 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [("127.0.0.1:7000", ("127.0.0.1", 7000)), ("switch-b:1", ("switch-b", 1)), ("[::1]:80", ("::1", 80))],
)
def test_parse_address_accepts(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize(
    "text", ["nonsense", "host:", ":7000", "host:port", "host:70000", "::1:80", "[::1]80"]
)
def test_parse_address_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="malformed target"):
        parse_address(text, "target")


def test_cli_rejects_malformed_target() -> None:
    result = CliRunner().invoke(app, ["emulate", "--target", "nonsense", "--listen", "127.0.0.1:0"])
    assert result.exit_code == 2, result.output
    assert "--target" in result.output


def test_cli_rejects_bad_bandwidth() -> None:
    result = CliRunner().invoke(app, ["emulate", "--target", "127.0.0.1:9", "--bandwidth-mbit", "0"])
    assert result.exit_code == 2, result.output
    assert "--bandwidth-mbit" in result.output


@pytest.mark.timeout(60)
def test_cli_serves_until_sigterm_then_exits_cleanly() -> None:
    listen_port = free_port()
    script = "import sys; from nebula_common.cli.wan import app; sys.argv[0] = 'wan'; app()"
    args = ["emulate", "--listen", f"127.0.0.1:{listen_port}", "--target", "127.0.0.1:9"]
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args, "--bandwidth-mbit", "10", "--delay-ms", "1"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 15
        while True:
            assert proc.poll() is None, proc.communicate()
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", listen_port), 0.2):
                break
            assert time.monotonic() < deadline, "emulator never started listening"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "Emulating WAN link" in out
    assert "Traceback" not in err and "destroyed" not in err, err
