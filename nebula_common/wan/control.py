"""The WAN emulator's control port: cut, restore and reset a running emulator from another process.

A ``nebula wan emulate --control HOST:PORT`` process (the local launcher starts its emulator this
way) answers one JSON request per connection, one line each way::

    -> {"command": "cut", "token": "..."}
    <- {"ok": true, "status": {"cut": true, "connections_open": 1, ...}}

Commands: ``status``, ``cut``, ``restore``, ``reset`` (the reply's ``reset`` says how many
connections were aborted). The port is meant for loopback only (tests, demos, a developer's
machine); when the emulator was given a token, a request without the same token is refused, so
another user of a shared machine cannot cut your link. :class:`WanControl` is the client (the
``nebula wan cut|restore|reset|status`` commands and ``LocalDeployment.wan`` use it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nebula_common.errors import NebulaError
from nebula_common.wan.address import parse_address
from nebula_common.wan.emulator import WanEmulator

logger = logging.getLogger(__name__)

COMMANDS = ("status", "cut", "restore", "reset")
_MAX_REQUEST_BYTES = 4096
_REQUEST_TIMEOUT_S = 5.0


class WanControlError(NebulaError):
    """The control port could not be reached, or it refused or failed the command."""


def read_token(path: Path) -> str:
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise WanControlError(f"cannot read WAN control token file {path}: {exc.strerror or exc}") from None
    if not token:
        raise WanControlError(f"WAN control token file {path} is empty")
    return token


def _answer(emulator: WanEmulator, request: Any, token: str | None) -> dict[str, Any]:
    if not isinstance(request, dict):
        return {"ok": False, "error": "request must be a JSON object"}
    if token is not None and not hmac.compare_digest(str(request.get("token", "")), token):
        return {"ok": False, "error": "bad or missing control token"}
    command = request.get("command")
    reply: dict[str, Any] = {"ok": True}
    if command == "cut":
        emulator.cut()
    elif command == "restore":
        emulator.restore()
    elif command == "reset":
        reply["reset"] = emulator.reset_connections()
    elif command != "status":
        return {"ok": False, "error": f"unknown command {command!r}; expected one of {', '.join(COMMANDS)}"}
    reply["status"] = emulator.status()
    return reply


async def start_control_server(
    emulator: WanEmulator, host: str, port: int, token: str | None = None
) -> asyncio.Server:
    """Serve the control protocol for ``emulator`` on ``host:port`` (in the emulator's event loop)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), _REQUEST_TIMEOUT_S)
            if len(line) > _MAX_REQUEST_BYTES:
                reply: dict[str, Any] = {"ok": False, "error": "request too long"}
            else:
                try:
                    request = json.loads(line or b"null")
                except ValueError:
                    reply = {"ok": False, "error": "request is not JSON"}
                else:
                    reply = _answer(emulator, request, token)
                    if reply["ok"]:
                        logger.info("WAN control: %s", request.get("command"))
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        except (OSError, TimeoutError) as exc:
            logger.debug("WAN control connection failed: %s", exc)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    server = await asyncio.start_server(handle, host, port, limit=_MAX_REQUEST_BYTES * 2)
    logger.info("WAN emulator control port on %s:%d", host, server.sockets[0].getsockname()[1])
    return server


@dataclass(frozen=True)
class WanControl:
    """Client of a running emulator's control port (``LocalDeployment.wan`` returns one)."""

    address: str
    token: str | None = None
    timeout: float = 10.0

    @classmethod
    def from_token_file(cls, address: str, token_file: Path | None) -> WanControl:
        return cls(address, read_token(token_file) if token_file is not None else None)

    def _call(self, command: str) -> dict[str, Any]:
        host, port = parse_address(self.address, "WAN control address")
        request: dict[str, Any] = {"command": command}
        if self.token is not None:
            request["token"] = self.token
        try:
            with socket.create_connection((host, port), timeout=self.timeout) as sock:
                sock.sendall(json.dumps(request).encode() + b"\n")
                data = b""
                while not data.endswith(b"\n"):
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    data += chunk
        except OSError as exc:
            raise WanControlError(
                f"cannot reach the WAN emulator's control port {self.address}: {exc.strerror or exc}"
            ) from None
        try:
            reply = json.loads(data)
        except ValueError:
            raise WanControlError(
                f"WAN control port {self.address} sent no valid answer: {data[:200]!r}"
            ) from None
        if not reply.get("ok"):
            raise WanControlError(
                f"WAN emulator refused {command!r}: {reply.get('error', 'no reason given')}"
            )
        return dict(reply)

    def status(self) -> dict[str, Any]:
        """The emulator's counters and whether it is cut."""
        return dict(self._call("status")["status"])

    def cut(self) -> dict[str, Any]:
        """Cut the link both ways (connections held open, nothing passes); returns the new status."""
        return dict(self._call("cut")["status"])

    def restore(self) -> dict[str, Any]:
        """End a cut; returns the new status."""
        return dict(self._call("restore")["status"])

    def reset_connections(self) -> int:
        """RST every connection the emulator carries; returns how many it aborted."""
        return int(self._call("reset")["reset"])


def control_attacher(
    control: str, token: str | None
) -> Callable[[WanEmulator], Awaitable[Callable[[], Awaitable[None]]]]:
    """An ``attach`` hook for ``run_emulator_forever`` that serves the control port at ``control``."""
    host, port = parse_address(control, "control address", allow_port_zero=True)

    async def attach(emulator: WanEmulator) -> Callable[[], Awaitable[None]]:
        server = await start_control_server(emulator, host, port, token)

        async def detach() -> None:
            server.close()
            await server.wait_closed()

        return detach

    return attach
