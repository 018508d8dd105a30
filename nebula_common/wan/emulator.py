"""Asyncio TCP proxy that makes a loopback or LAN hop behave like a slow WAN link.

Nebula's whole point is training across clusters joined by thin, long links, so the two
switch gateways must be tested against a link with realistic bandwidth and latency. Kernel
tools (``tc netem``) need root and are per-interface; this proxy needs neither. Like a full-duplex
WAN circuit it shapes each direction on its own, and within a direction the *aggregate* of all the
connections it carries shares one fair token bucket (``nebula_common.wan.shaper``), so opening more
connections cannot buy more bandwidth than the link has. ``bench/wan/link.py`` checks it against
kernel shaping (``tc tbf`` between two network namespaces, same bytes).

Fault controls, so link faults are scripted and repeatable (``nebula wan cut|restore|reset``):

- ``cut()``: the path goes dark both ways. Connections stay open and nothing passes: the proxy stops
  reading (so the senders' kernel buffers fill and TCP back-pressure stops them, as unacknowledged
  segments would) and stops delivering what it already holds. Bytes in flight are *held*, not dropped:
  the proxy terminates TCP on both sides, so a dropped byte could never be retransmitted and would
  corrupt the (TLS) stream, whereas on a real cut TCP retransmits every lost segment once the path is
  back. New connections are accepted but pass nothing, and the far end is not even dialled (on a real
  cut the SYN would not arrive either) until the path returns. A connection whose endpoints give up
  during the cut (keepalive timeout) dies from their side, as it would on a real WAN.
- ``restore()``: held bytes continue, each no earlier than one propagation delay after the restore;
  held connections dial the far end.
- ``reset_connections()``: every connection the proxy carries is aborted with a TCP RST on both
  sides, like a NAT or middlebox that lost its state; the listener stays up, so endpoints may
  reconnect at once (unless the path is cut).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
from collections.abc import Awaitable, Callable

from nebula_common.wan.address import parse_address
from nebula_common.wan.direction import Direction, reset, set_nodelay
from nebula_common.wan.shape import LinkShape
from nebula_common.wan.shaper import AggregateLink, LinkGate

__all__ = ["LinkShape", "WanEmulator", "run_emulator_forever"]

logger = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 10.0


class WanEmulator:
    """TCP proxy from ``listen`` to ``target`` that shapes each direction to ``shape``."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        shape: LinkShape,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
    ) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.shape = shape
        self.listen_host = listen_host
        self._listen_port = listen_port
        self._server: asyncio.Server | None = None
        self._closing = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._ids = itertools.count(1)
        self._bytes_upstream = 0
        self._bytes_downstream = 0
        self._connections_total = 0
        self._gate: LinkGate | None = None
        # One shared link per direction (created in the running loop) and their pacer tasks.
        self._up_link: AggregateLink | None = None
        self._down_link: AggregateLink | None = None
        self._pacers: set[asyncio.Task[None]] = set()
        self._cut_requested = False
        self._cuts_total = 0
        self._resets_total = 0

    @property
    def port(self) -> int:
        """Bound port once started (the requested port before, which may be 0)."""
        return self._listen_port

    @property
    def bytes_upstream(self) -> int:
        """Bytes delivered client -> target, counted when handed to the target socket."""
        return self._bytes_upstream

    @property
    def bytes_downstream(self) -> int:
        """Bytes delivered target -> client, counted when handed to the client socket."""
        return self._bytes_downstream

    @property
    def wire_bytes_upstream(self) -> int:
        """Bytes the client -> target link carried, headers and retransmissions included."""
        return self._up_link.wire_bytes if self._up_link is not None else 0

    @property
    def wire_bytes_downstream(self) -> int:
        """Bytes the target -> client link carried, headers and retransmissions included."""
        return self._down_link.wire_bytes if self._down_link is not None else 0

    @property
    def losses_upstream(self) -> int:
        """Segments the loss model dropped (and had retransmitted) client -> target."""
        return self._up_link.losses if self._up_link is not None else 0

    @property
    def losses_downstream(self) -> int:
        """Segments the loss model dropped (and had retransmitted) target -> client."""
        return self._down_link.losses if self._down_link is not None else 0

    @property
    def connections_total(self) -> int:
        """Client connections accepted, including ones whose target could not be reached."""
        return self._connections_total

    @property
    def is_cut(self) -> bool:
        """True between ``cut()`` and ``restore()``."""
        return self._cut_requested

    @property
    def connections_open(self) -> int:
        """Client connections the proxy currently carries (including ones held by a cut)."""
        return len(self._tasks)

    @property
    def cuts_total(self) -> int:
        return self._cuts_total

    @property
    def resets_total(self) -> int:
        """Connections aborted by ``reset_connections()`` so far."""
        return self._resets_total

    def _link_state(self) -> LinkGate:
        # Created lazily inside the running loop (asyncio primitives bind to it on first use).
        if self._gate is None:
            self._gate = LinkGate()
            if self._cut_requested:
                self._gate.cut()
        return self._gate

    def _links(self) -> tuple[AggregateLink, AggregateLink]:
        """The shared upstream and downstream links, their pacers started on first use."""
        if self._up_link is None or self._down_link is None:
            gate = self._link_state()
            self._up_link = AggregateLink(self.shape, gate, "up")
            self._down_link = AggregateLink(self.shape, gate, "down")
            loop = asyncio.get_running_loop()
            for link in (self._up_link, self._down_link):
                task = loop.create_task(link.run(), name=f"wan-pacer-{link.name}")
                self._pacers.add(task)
                task.add_done_callback(self._pacers.discard)
        return self._up_link, self._down_link

    def cut(self) -> None:
        """Stop forwarding both ways: connections stay open, nothing passes (see the module doc)."""
        if not self._cut_requested:
            self._cuts_total += 1
            logger.warning("WAN emulator: link CUT (connections held open, nothing passes)")
        self._cut_requested = True
        if self._gate is not None:
            self._gate.cut()

    def restore(self) -> None:
        """End a cut: held bytes continue after one propagation delay, held connections dial out."""
        if self._cut_requested:
            logger.warning("WAN emulator: link RESTORED")
        self._cut_requested = False
        if self._gate is not None:
            self._gate.restore()

    def reset_connections(self) -> int:
        """Abort every carried connection with a TCP RST on both sides; returns how many.

        Must be called in the emulator's event loop (the control server does). The listener keeps
        accepting, so endpoints may reconnect at once.
        """
        tasks = [task for task in self._tasks if not task.done()]
        for task in tasks:
            task.cancel()  # _serve's cleanup aborts both sockets with RST
        self._resets_total += len(tasks)
        logger.warning("WAN emulator: reset %d connection(s)", len(tasks))
        return len(tasks)

    def status(self) -> dict[str, object]:
        """A JSON-friendly snapshot for the control port and tests."""
        return {
            "listen": f"{self.listen_host}:{self._listen_port}",
            "target": f"{self.target_host}:{self.target_port}",
            "bandwidth_mbit": self.shape.bandwidth_mbit,
            "delay_ms": self.shape.delay_ms,
            "loss": self.shape.loss,
            "mtu": self.shape.mtu,
            "seed": self.shape.seed,
            "cut": self.is_cut,
            "connections_open": self.connections_open,
            "connections_total": self.connections_total,
            "cuts_total": self.cuts_total,
            "resets_total": self.resets_total,
            "bytes_upstream": self.bytes_upstream,
            "bytes_downstream": self.bytes_downstream,
            "wire_bytes_upstream": self.wire_bytes_upstream,
            "wire_bytes_downstream": self.wire_bytes_downstream,
            "losses_upstream": self.losses_upstream,
            "losses_downstream": self.losses_downstream,
        }

    async def start(self) -> int:
        if self._server is not None or self._closing:
            raise RuntimeError("WanEmulator can only be started once")
        self._links()
        self._server = await asyncio.start_server(self._on_client, self.listen_host, self._listen_port)
        self._listen_port = self._server.sockets[0].getsockname()[1]
        logger.info(
            "WAN emulator listening on %s:%d -> %s:%d (%g Mbit/s, %g ms one-way, loss %g, MTU %d;"
            " all connections share each direction)",
            self.listen_host,
            self._listen_port,
            self.target_host,
            self.target_port,
            self.shape.bandwidth_mbit,
            self.shape.delay_ms,
            self.shape.loss,
            self.shape.mtu,
        )
        return self._listen_port

    async def stop(self) -> None:
        self._closing = True
        server, self._server = self._server, None
        if server is not None:
            server.close()
        tasks = list(self._tasks) + list(self._pacers)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    async def __aenter__(self) -> WanEmulator:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A plain callback (not a coroutine) so the task is created and tracked synchronously;
        # otherwise stop() could miss a connection accepted in the same loop iteration.
        self._connections_total += 1
        if self._closing:
            reset(writer)
            return
        conn_id = next(self._ids)
        task = asyncio.get_running_loop().create_task(
            self._serve(conn_id, reader, writer), name=f"wan-conn-{conn_id}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(
        self, conn_id: int, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        peer = client_writer.get_extra_info("peername")
        set_nodelay(client_writer)
        link = self._link_state()
        try:
            # During a cut the connection is accepted but the far end is not dialled until restore.
            await link.wait_up()
            target_reader, target_writer = await asyncio.wait_for(
                asyncio.open_connection(self.target_host, self.target_port), _CONNECT_TIMEOUT_S
            )
        except (OSError, TimeoutError) as exc:
            logger.warning(
                "WAN emulator conn %d from %s: cannot reach target %s:%d (%s); closing client",
                conn_id,
                peer,
                self.target_host,
                self.target_port,
                exc or type(exc).__name__,
            )
            reset(client_writer)
            return
        except BaseException:
            reset(client_writer)
            raise
        set_nodelay(target_writer)

        def count_up(n: int) -> None:
            self._bytes_upstream += n

        def count_down(n: int) -> None:
            self._bytes_downstream += n

        up_link, down_link = self._links()
        up_flow, down_flow = up_link.flow(), down_link.flow()
        delay_s = self.shape.delay_s
        up = Direction(client_reader, target_writer, up_flow, count_up, link, delay_s)
        down = Direction(target_reader, client_writer, down_flow, count_down, link, delay_s)
        clean = False
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(up.read_loop(), name=f"wan-conn-{conn_id}-up-read")
                group.create_task(up.write_loop(), name=f"wan-conn-{conn_id}-up-write")
                group.create_task(down.read_loop(), name=f"wan-conn-{conn_id}-down-read")
                group.create_task(down.write_loop(), name=f"wan-conn-{conn_id}-down-write")
            clean = True
        except* OSError as group_exc:
            logger.debug("WAN emulator conn %d from %s reset: %s", conn_id, peer, group_exc.exceptions)
        except* Exception:
            logger.exception("WAN emulator conn %d from %s failed", conn_id, peer)
        finally:
            # Whatever this connection still had queued must not take link time from the others.
            up_link.drop(up_flow)
            down_link.drop(down_flow)
            if not clean:
                # Covers resets, unexpected errors and cancellation by stop(): no awaiting here.
                reset(client_writer)
                reset(target_writer)
        for writer in (client_writer, target_writer):
            writer.close()
        for writer in (client_writer, target_writer):
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def run_emulator_forever(
    target: str,
    listen: str,
    shape: LinkShape,
    *,
    attach: Callable[[WanEmulator], Awaitable[Callable[[], Awaitable[None]]]] | None = None,
) -> None:
    """Blocking entry point for the CLI: serve until SIGINT/SIGTERM, then shut down cleanly.

    ``attach`` runs once the emulator listens, in its event loop (the control port uses it) and
    returns a coroutine function that undoes it at shutdown.
    """
    target_host, target_port = parse_address(target, "target address")
    listen_host, listen_port = parse_address(listen, "listen address", allow_port_zero=True)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        installed: list[signal.Signals] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
                installed.append(sig)
            except (NotImplementedError, RuntimeError):
                # No loop signal support (e.g. Windows): Ctrl-C cancels main() via asyncio.run.
                pass
        try:
            async with WanEmulator(target_host, target_port, shape, listen_host, listen_port) as emulator:
                detach = await attach(emulator) if attach is not None else None
                try:
                    await stop.wait()
                finally:
                    if detach is not None:
                        await detach()
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
