"""The WAN emulator's fault controls (cut, restore, reset) and its control port, over real sockets."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nebula_common.cli.wan import app
from nebula_common.wan import LinkShape, WanEmulator
from nebula_common.wan.control import WanControl, WanControlError, start_control_server
from tests.unit.test_wan_emulator import run, serve

pytestmark = pytest.mark.timeout(60)

SHAPE = LinkShape(bandwidth_mbit=100.0, delay_ms=2.0)
# How long "nothing passes" is observed. Absence can only be shown over a window; the window is
# many times the emulated delay, and every positive expectation below waits on its own deadline.
QUIET_S = 0.5
DEADLINE_S = 10.0


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()


async def read_exactly(reader: asyncio.StreamReader, n: int) -> bytes:
    return await asyncio.wait_for(reader.readexactly(n), DEADLINE_S)


async def nothing_arrives(reader: asyncio.StreamReader) -> None:
    with pytest.raises(TimeoutError):
        data = await asyncio.wait_for(reader.read(1), QUIET_S)
        raise AssertionError(f"bytes passed a cut link: {data!r}")


def test_cut_holds_bytes_both_ways_and_restore_delivers_them_in_order() -> None:
    async def scenario() -> None:
        async with serve(echo) as target, WanEmulator("127.0.0.1", target, SHAPE) as emulator:
            reader, writer = await asyncio.open_connection("127.0.0.1", emulator.port)
            writer.write(b"before")
            assert await read_exactly(reader, 6) == b"before"

            emulator.cut()
            assert emulator.is_cut and emulator.status()["cut"] is True
            up_before = emulator.bytes_upstream
            writer.write(b"during-the-cut")
            await writer.drain()
            await nothing_arrives(reader)
            assert emulator.bytes_upstream == up_before  # not even the upstream half passed
            assert emulator.connections_open == 1  # the connection stays open

            emulator.restore()
            assert await read_exactly(reader, 14) == b"during-the-cut"
            writer.write(b"after")
            assert await read_exactly(reader, 5) == b"after"
            assert emulator.cuts_total == 1
            writer.close()

    run(scenario())


def test_a_cut_holds_bytes_already_inside_the_emulator_in_the_down_direction() -> None:
    """The far end's reply is held too, not only what the near end sends after the cut."""

    async def scenario() -> None:
        release = asyncio.Event()

        async def late_reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readexactly(4)
            await release.wait()
            writer.write(b"reply")
            await writer.drain()
            await reader.read()

        async with serve(late_reply) as target, WanEmulator("127.0.0.1", target, SHAPE) as emulator:
            reader, writer = await asyncio.open_connection("127.0.0.1", emulator.port)
            writer.write(b"ping")
            await writer.drain()
            deadline = asyncio.get_running_loop().time() + DEADLINE_S
            while emulator.bytes_upstream < 4:
                assert asyncio.get_running_loop().time() < deadline, "ping never reached the target"
                await asyncio.sleep(0.01)
            emulator.cut()
            release.set()
            await nothing_arrives(reader)
            emulator.restore()
            assert await read_exactly(reader, 5) == b"reply"
            writer.close()

    run(scenario())


def test_new_connections_during_a_cut_are_accepted_but_reach_nothing_until_restore() -> None:
    async def scenario() -> None:
        arrived = asyncio.Event()

        async def greeter(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            arrived.set()
            await echo(reader, writer)

        async with serve(greeter) as target, WanEmulator("127.0.0.1", target, SHAPE) as emulator:
            emulator.cut()
            reader, writer = await asyncio.open_connection("127.0.0.1", emulator.port)  # accepted
            writer.write(b"hello")
            await nothing_arrives(reader)
            assert not arrived.is_set(), "the far end was dialled during a cut"
            assert emulator.connections_open == 1
            emulator.restore()
            assert await read_exactly(reader, 5) == b"hello"
            assert arrived.is_set()
            writer.close()

    run(scenario())


def test_reset_connections_sends_rst_both_ways_and_keeps_listening() -> None:
    async def scenario() -> None:
        target_saw: list[BaseException | bytes] = []

        async def watcher(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await echo(reader, writer)
                target_saw.append(b"eof")
            except ConnectionResetError as exc:
                target_saw.append(exc)

        async with serve(watcher) as target, WanEmulator("127.0.0.1", target, SHAPE) as emulator:
            reader, writer = await asyncio.open_connection("127.0.0.1", emulator.port)
            writer.write(b"x")
            assert await read_exactly(reader, 1) == b"x"

            assert emulator.reset_connections() == 1
            with pytest.raises(ConnectionResetError):  # RST, not a clean end of stream
                await asyncio.wait_for(reader.read(1), DEADLINE_S)
            deadline = asyncio.get_running_loop().time() + DEADLINE_S
            while not target_saw:
                assert asyncio.get_running_loop().time() < deadline, "the target never saw the reset"
                await asyncio.sleep(0.01)
            assert isinstance(target_saw[0], ConnectionResetError), target_saw
            assert emulator.resets_total == 1 and emulator.connections_open == 0
            writer.close()

            reader, writer = await asyncio.open_connection("127.0.0.1", emulator.port)  # still listening
            writer.write(b"again")
            assert await read_exactly(reader, 5) == b"again"
            writer.close()

    run(scenario())


def test_reset_during_a_cut_aborts_held_connections_too() -> None:
    async def scenario() -> None:
        async with serve(echo) as target, WanEmulator("127.0.0.1", target, SHAPE) as emulator:
            emulator.cut()
            reader, writer = await asyncio.open_connection("127.0.0.1", emulator.port)
            deadline = asyncio.get_running_loop().time() + DEADLINE_S
            while emulator.connections_open < 1:
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)
            assert emulator.reset_connections() == 1
            with pytest.raises(ConnectionResetError):
                await asyncio.wait_for(reader.read(1), DEADLINE_S)
            writer.close()

    run(scenario())


def test_control_port_drives_the_emulator_and_checks_the_token() -> None:
    async def scenario() -> None:
        async with serve(echo) as target, WanEmulator("127.0.0.1", target, SHAPE) as emulator:
            server = await start_control_server(emulator, "127.0.0.1", 0, token="s3cret")
            address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
            try:
                control = WanControl(address, token="s3cret")
                reader, writer = await asyncio.open_connection("127.0.0.1", emulator.port)
                writer.write(b"x")
                assert await read_exactly(reader, 1) == b"x"

                status = await asyncio.to_thread(control.cut)
                assert status["cut"] is True and emulator.is_cut
                assert (await asyncio.to_thread(control.restore))["cut"] is False
                assert await asyncio.to_thread(control.reset_connections) == 1
                with pytest.raises(ConnectionResetError):
                    await asyncio.wait_for(reader.read(1), DEADLINE_S)
                writer.close()

                with pytest.raises(WanControlError, match="bad or missing control token"):
                    await asyncio.to_thread(WanControl(address, token="wrong").cut)
                with pytest.raises(WanControlError, match="bad or missing control token"):
                    await asyncio.to_thread(WanControl(address).status)
                assert not emulator.is_cut
            finally:
                server.close()
                await server.wait_closed()

    run(scenario())


def test_control_client_names_an_unreachable_port() -> None:
    with pytest.raises(WanControlError, match=r"cannot reach the WAN emulator's control port 127\.0\.0\.1:1"):
        WanControl("127.0.0.1:1", timeout=2).status()


def test_cli_control_commands_explain_a_missing_deployment(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["cut", "--run-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert "deployment.json not found" in result.output and "Traceback" not in result.output
    (tmp_path / "deployment.json").write_text(json.dumps({"clusters": {}}))
    result = CliRunner().invoke(app, ["status", "--run-dir", str(tmp_path)])
    assert result.exit_code == 1 and "names no WAN emulator control port" in result.output
    result = CliRunner().invoke(app, ["restore"])
    assert result.exit_code == 1 and "exactly one of --run-dir" in result.output
