"""Revocation over the WAN port: each switch sends its peer its own CA's CRL, now and on every change.

Served as ``nebula.v1.SwitchTrust/ExchangeCrl`` on the WAN port (same mutual TLS as the link, only
a configured peer switch may call it, and its certificate picks that peer's exchange: a switch with
several peers runs one per peer, services/switch/peers.py); the dialing switch opens it on its own
connection and keeps it open, reconnecting with backoff. Both ends then run the same
:class:`CrlExchange`: send the current CRL of this cluster's CA (re-read when ``nebula pki revoke``
rewrites the file, polled like every other file the switch watches) and hand whatever the peer
sends to :class:`PeerTrust`, which
verifies it against the pinned peer CA before enforcing it. A CRL that revokes the live peer closes
the link at once. The stream is independent of the data link, so it keeps flowing while the link is
refused, and carries no training data.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509

from nebula_common.cancellation import raise_if_cancelling
from nebula_common.pki import peer_certificate, peer_identity
from nebula_common.pki.crl import CrlError, crl_number
from nebula_common.proto.nebula.v1 import trust_pb2, trust_pb2_grpc
from services.switch.link import PeerLink
from services.switch.peer_trust import PeerTrust
from services.switch.peers import PeerLinks

log = logging.getLogger(__name__)

ReadFn = Callable[[], Awaitable[Any]]
WriteFn = Callable[[trust_pb2.CrlUpdate], Awaitable[None]]


class OwnCrl:
    """This cluster's CA CRL file (``<pki>/<cluster>/crl.pem``), re-read when it changes."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int, int] | None = None
        self._current: tuple[bytes, int] | None = None

    def read(self) -> tuple[bytes, int] | None:
        """(PEM, CRLNumber) of the newest readable CRL, or None if there never was one."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return self._current
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp != self._stamp:
            try:
                pem = self.path.read_bytes()
                number = crl_number(x509.load_pem_x509_crl(pem))
            except (OSError, ValueError) as exc:
                log.error("not sending %s to the peer: %s", self.path, exc)
                return self._current
            self._stamp = stamp
            self._current = (pem, number)
        return self._current


class CrlExchange:
    """One side of an ``ExchangeCrl`` stream; the same on the dialing and the accepting switch."""

    def __init__(self, link: PeerLink, trust: PeerTrust, own: OwnCrl | None, *, poll_s: float = 0.5) -> None:
        self.link = link
        self.trust = trust
        self.own = own
        self.poll_s = poll_s

    async def run(self, read: ReadFn, write: WriteFn, peer: str) -> None:
        """Send and receive until the stream ends (or either direction fails)."""
        tasks = [
            asyncio.create_task(self._send(write), name="crl-send"),
            asyncio.create_task(self._receive(read, peer), name="crl-receive"),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await task

    async def _send(self, write: WriteFn) -> None:
        sent: bytes | None = None
        while True:
            current = self.own.read() if self.own is not None else None
            if current is not None and current[0] != sent:
                pem, number = current
                await write(
                    trust_pb2.CrlUpdate(cluster_id=self.link.cluster_id, crl_pem=pem, crl_number=number)
                )
                sent = pem
                self.link.record("crl.send", crl_number=number, peer=self.link.expected_peer.uri)
            await asyncio.sleep(self.poll_s)

    async def _receive(self, read: ReadFn, peer: str) -> None:
        while True:
            update = await read()
            if update is grpc.aio.EOF:
                return
            if update.cluster_id != self.trust.peer_cluster_id:
                expected = self.trust.peer_cluster_id
                reason = f"CRL update claims cluster {update.cluster_id!r}, expected {expected!r}"
                self.link.record("crl.refused", outcome="refused", reason=reason, address=peer)
                continue
            try:
                loaded = await asyncio.to_thread(
                    self.trust.apply, bytes(update.crl_pem), source=f"CRL sent by peer switch at {peer}"
                )
            except CrlError as exc:
                self.link.record("crl.refused", outcome="refused", reason=str(exc), address=peer)
                log.error("refusing the peer's CRL: %s", exc)
                continue
            if loaded is None:
                continue
            self.link.record(
                "crl.apply",
                source="link",
                crl_number=loaded.number,
                revoked=len(loaded.revoked),
                next_update=loaded.next_update.isoformat(),
            )
            log.info(
                "applied peer CRL #%d (%d revoked) received over the link", loaded.number, len(loaded.revoked)
            )
            self.link.enforce_revocation()


class SwitchTrustServicer(trust_pb2_grpc.SwitchTrustServicer):
    """``ExchangeCrl`` on the WAN port: only a configured peer switch is answered, by its own exchange."""

    def __init__(self, links: PeerLinks, exchanges: dict[str, CrlExchange]) -> None:
        self.links = links
        self.exchanges = exchanges

    async def ExchangeCrl(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        try:
            certified = peer_identity(context)
            link = self.links.select(certified)
        except PermissionError as exc:
            self.links.refuse("identity", str(exc), address=context.peer(), rpc="ExchangeCrl")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        # Only the genuine peer's certificate (issued by a CA pinned to it, not revoked) is answered.
        if (refused := link.refusal(peer_certificate(context))) is not None:
            layer, reason = refused
            link.refuse(layer, reason, address=context.peer(), rpc="ExchangeCrl", identity=certified.uri)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)
        await self.exchanges[link.expected_peer.cluster_id].run(context.read, context.write, context.peer())


def add_trust_to_server(links: PeerLinks, exchanges: dict[str, CrlExchange], server: grpc.aio.Server) -> None:
    trust_pb2_grpc.add_SwitchTrustServicer_to_server(SwitchTrustServicer(links, exchanges), server)


async def exchange_forever(
    address: str,
    credentials: Callable[[], grpc.ChannelCredentials],
    options: list[tuple[str, object]],
    exchange: CrlExchange,
    *,
    backoff_max_s: float = 10.0,
) -> None:
    """The dialing switch's side: keep an ``ExchangeCrl`` stream to the peer open, forever."""
    backoff = 0.5
    while True:
        try:
            async with grpc.aio.secure_channel(address, credentials(), options=options) as channel:
                call = trust_pb2_grpc.SwitchTrustStub(channel).ExchangeCrl()
                await exchange.run(call.read, call.write, address)
                backoff = 0.5
        except grpc.aio.AioRpcError as exc:
            log.info("CRL exchange with %s ended: %s %s", address, exc.code().name, exc.details())
        except Exception:  # one broken stream must not end revocation for good
            log.exception("CRL exchange with %s failed", address)
        raise_if_cancelling()  # a stop whose cancellation an awaited call swallowed ends here
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, backoff_max_s)
