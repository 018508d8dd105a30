"""The switch's WAN port: per-source slots, records link connections served, gRPC ones passed through.

Every switch owns its WAN port in Python so that it can give each source address a few slots before
its handshake completes (``source_limits.py``) and serve both kinds on one address: a connection that
starts with the records preamble is a records link connection (preamble, mutual TLS 1.3 through
pyOpenSSL on a thread, the sealed-records negotiation inside it, then ``rawlink_acceptor.serve_raw``);
one that starts with a TLS record is relayed byte for byte to gRPC's WAN server on loopback
(``passthrough.py``): the link handshake that agrees on the carrier, and the gRPC link itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable

from OpenSSL import SSL

from nebula_common.rpc.blocking_steps import in_thread
from nebula_common.rpc.exporter_tls import handshake as openssl_handshake
from nebula_common.rpc.sealed_negotiation import negotiate_acceptor
from nebula_common.rpc.sealed_records import SealedRecordError
from services.switch import passthrough
from services.switch.link_handshake import HANDSHAKE_TIMEOUT_S
from services.switch.peers import PeerLinks
from services.switch.rawlink_acceptor import serve_raw
from services.switch.rawlink_connection import OLD_PREAMBLES, PREAMBLE, RawConnection, Secured
from services.switch.source_limits import UNTRUSTED_ROOM, SourceLimits

log = logging.getLogger(__name__)

MAX_RAW_HANDSHAKES = 16
"""Records link TLS handshakes the frontend runs at once (each on a thread of its own, bounded by the
timeout)."""


async def _readable(sock: socket.socket, timeout: float) -> bool:
    """Wait until ``sock`` has bytes (or EOF) to read; False on timeout."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(sock.fileno(), lambda: ready.done() or ready.set_result(None))
    try:
        await asyncio.wait_for(ready, timeout)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(sock.fileno())


class WanFrontend:
    """The WAN port of a switch: per-source slots for every connection (source_limits.py), records
    connections served here (``serves_raw``), gRPC ones passed through to the gRPC WAN server.

    ``backend`` is the loopback address of the gRPC WAN server; ``context`` returns the current server
    TLS context as pyOpenSSL's (hot reload); ``handshake_timeout_s`` bounds preamble + TLS + the link
    handshake, as ``grpc.server_handshake_timeout_ms`` does on the gRPC port.
    """

    def __init__(
        self,
        links: PeerLinks,
        backend: str,
        context: Callable[[], SSL.Context],
        *,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        send_buffer: int = 0,
        serves_raw: bool = True,
        grpc_max_connections: int | None = None,
    ) -> None:
        self.links = links
        #: Records link connections are served here (``link_carrier=records``); else they are refused.
        self.serves_raw = serves_raw
        self.send_buffer = send_buffer
        self.backend = backend
        self.context = context
        self.handshake_timeout_s = handshake_timeout_s
        self._listener: socket.socket | None = None
        self._acceptor: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._handshakes = asyncio.Semaphore(MAX_RAW_HANDSHAKES)
        #: Slots per source address until mutual TLS completes (source_limits.py); relayed connections of
        #: unknown addresses leave room under the gRPC WAN server's cap for the known peer's.
        untrusted = None if grpc_max_connections is None else grpc_max_connections - UNTRUSTED_ROOM
        self.limits = SourceLimits(relayed_untrusted=untrusted)

    async def start(self, listen: str) -> int:
        host, _, port = listen.rpartition(":")
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        listener = socket.create_server((host.strip("[]"), int(port)), family=family, backlog=128)
        listener.setblocking(False)
        self._listener = listener
        self._acceptor = asyncio.create_task(self._accept_forever(), name="wan-frontend")
        return int(listener.getsockname()[1])

    async def stop(self) -> None:
        if self._acceptor is not None:
            self._acceptor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._acceptor
        if self._listener is not None:
            self._listener.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _accept_forever(self) -> None:
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, address = await loop.sock_accept(self._listener)
            except OSError as exc:  # e.g. out of file descriptors: keep the port, try again shortly
                log.warning("WAN frontend accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            host, peer = str(address[0]), f"{address[0]}:{address[1]}"
            if (refused := self.limits.admit(host)) is not None:
                conn.close()
                self.links.refuse("limit", refused, address=peer)
                continue
            task = asyncio.create_task(self._accepted(conn, peer, host))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _accepted(self, conn: socket.socket, peer: str, host: str) -> None:
        handed_off = False
        slot: list[str] = ["pending"]  # the kind of slot this connection holds ([] once released)

        def authenticated() -> None:
            if slot:
                self.limits.release(host, slot.pop())

        try:
            conn.setblocking(False)
            if not await _readable(conn, self.handshake_timeout_s):
                return
            try:
                first = conn.recv(1, socket.MSG_PEEK)
            except (BlockingIOError, OSError):
                return
            if not first:
                return
            if first == PREAMBLE[:1]:
                if not self.serves_raw:
                    self.links.refuse(
                        "transport",
                        "the dialer opened a records link connection, but this switch's link carrier "
                        "is grpc (NEBULA_SWITCH_LINK_CARRIER must be the same on both switches)",
                        address=peer,
                    )
                    return
                handed_off = await self._raw(conn, peer, authenticated)
            else:
                slot.clear()
                if (refused := self.limits.move(host, "relayed")) is not None:
                    self.links.refuse("limit", refused, address=peer)
                    return
                slot.append("relayed")
                handed_off = True
                # gRPC drops a connection that has not finished mutual TLS within the handshake timeout:
                # one still relayed after it comes from an authenticated peer.
                known = asyncio.get_running_loop().call_later(
                    self.handshake_timeout_s + 1.0, self.limits.trust, host
                )
                try:
                    await self._pass_through(conn)
                finally:
                    known.cancel()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one connection's failure never takes the port down
            log.warning("WAN connection from %s ended: %s", peer, exc)
        finally:
            authenticated()
            if not handed_off:
                conn.close()

    async def _pass_through(self, conn: socket.socket) -> None:
        """A gRPC (TLS) peer: relay its encrypted bytes to the gRPC WAN server and back, untouched."""
        await passthrough.relay(conn, self.backend)

    async def _raw(self, conn: socket.socket, peer: str, authenticated: Callable[[], None]) -> bool:
        """Preamble, mutual TLS (on a thread), then the link handshake and session; True once handed off.

        ``authenticated`` is called once mutual TLS has completed: the source's slot is free from then.
        """
        links = self.links
        loop = asyncio.get_running_loop()
        preamble = b""
        deadline = loop.time() + self.handshake_timeout_s
        while len(preamble) < len(PREAMBLE):
            left = deadline - loop.time()
            if left <= 0 or not await _readable(conn, left):
                return False
            part = conn.recv(len(PREAMBLE) - len(preamble))
            if not part:
                return False
            preamble += part
        if (old := OLD_PREAMBLES.get(preamble)) is not None:
            reason = (
                f"the dialer offers {old} ({preamble!r}), which this switch does not carry; it speaks "
                f"{PREAMBLE!r} (sealed records keyed by the TLS exporter): update the older switch"
            )
            links.refuse("transport", reason, address=peer)
            return False
        if preamble != PREAMBLE:
            links.refuse("transport", "connection sent neither TLS nor the records preamble", address=peer)
            return False
        if self._handshakes.locked():
            links.refuse(
                "handshake", f"more than {MAX_RAW_HANDSHAKES} records TLS handshakes at once", address=peer
            )
            return False
        async with self._handshakes:
            await loop.sock_sendall(conn, preamble)
            context = self.context()
            timeout = max(0.1, deadline - loop.time())

            def handshake() -> Secured:
                ends = time.monotonic() + timeout
                tls, cert = openssl_handshake(conn, context, server_name=None, deadline=ends)
                carrier, sealing = negotiate_acceptor(tls, conn, ends)
                return carrier, sealing, cert

            try:
                carrier, sealing, cert = await in_thread(handshake, f"raw-link-accept {peer}")
            except SealedRecordError as exc:  # TLS held: the negotiation inside it was refused
                links.refuse("transport", f"records link refused: {exc}", address=peer)
                log.warning("refused records WAN link from %s: %s", peer, exc)
                return False
            except (SSL.Error, OSError) as exc:  # Timeout/TlsHandshake: both OSErrors
                reason = str(exc) or "no TLS handshake in time"
                links.refuse("tls", f"records link TLS handshake refused: {reason}", address=peer)
                log.warning("refused raw WAN link from %s: %s", peer, reason)
                return False
        authenticated()
        self.limits.trust(peer.rpartition(":")[0].strip("[]"))
        with contextlib.suppress(OSError):
            carrier.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection = RawConnection(carrier, peer, loop, self.send_buffer, sealing, cert, preamble)
        try:
            await serve_raw(links, connection, self.handshake_timeout_s)
        finally:
            await connection.close()
        return True


__all__ = ["MAX_RAW_HANDSHAKES", "WanFrontend"]
