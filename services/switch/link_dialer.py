"""The dialer's side of the link: connect to the peer, check it, run the session, reconnect.

The cluster whose id sorts first dials (through the WAN, via mTLS); the other accepts
(``wan_servicer.py``, ``rawlink.py``). The dialer learns the certificate the peer presents first
(``link_handshake.fetch_server_certificate``), so a revoked or untrusted peer is refused before the link
starts, then handshakes on a gRPC call. With a ``raw_dialer`` (the records carrier) that handshake offers
records; a peer of the same carrier ends the call and the session runs over records connections instead
(``rawlink.py``), whose certificates get the same checks here; a peer of the other carrier is refused.
A striping dialer then opens the session's further connections (``link_lanes.py``). Any failure is
retried with capped exponential backoff.

:class:`LinkDialer` is part of :class:`~services.switch.link.PeerLink`, which provides the session
(``run_session``); the identity checks are ``link_handshake.PeerChecks``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from collections.abc import Awaitable, Callable

import grpc
from cryptography import x509

from nebula_common.cancellation import raise_if_cancelling
from nebula_common.proto.nebula.v1 import link_pb2
from nebula_common.rpc.exporter_tls import TlsHandshakeError
from nebula_common.rpc.sealed_records import SealedRecordError
from services.switch.link_handshake import (
    HANDSHAKE_TIMEOUT_S,
    RAW_LINK_VERSION,
    HandshakeError,
    PeerChecks,
    PreambleError,
    carrier_mismatch,
    parse_link_message,
    raw_peer_identity,
)
from services.switch.link_lanes import LinkLanes
from services.switch.link_transport import (
    LINK_METHOD,
    Closeable,
    CredentialsFn,
    LaneOpenFn,
    ProbeFn,
    RawConnectionLike,
    RawDialFn,
    ReadFn,
    WriteFn,
    grpc_writer,
)

log = logging.getLogger(__name__)


class LinkDialer(LinkLanes, PeerChecks):
    """Dialing the peer and keeping the link up (see the module doc): lanes and checks included."""

    #: Opens a raw connection to the peer (offered in the handshake; None: gRPC only).
    raw_dialer: RawDialFn | None
    _stopping: bool
    run_session: Callable[..., Awaitable[None]]
    """The session on the connection the dialer opened (``PeerLink.run_session``)."""

    async def dial_forever(
        self,
        address: str,
        credentials: CredentialsFn,
        options: list[tuple[str, object]],
        probe: ProbeFn | None = None,
    ) -> None:
        """Keep one link to the peer up, reconnecting with capped exponential backoff.

        ``credentials`` is called on every attempt so a renewed certificate is used at the next
        reconnect; ``probe`` (when given) learns the certificate the peer presents, so a revoked
        peer is refused before the link starts and the session can be closed if it is revoked later.
        With a ``raw_dialer`` the gRPC handshake offers the records carrier; a peer that takes it ends
        the call and the session runs over a records connection instead (rawlink.py). A peer whose
        carrier differs is refused (audited, layer ``transport``) and dialed again after the backoff.
        """
        backoff = 0.2
        while not self._stopping:
            try:
                peer_cert = await probe() if probe is not None else None
                if (refused := self.refusal(peer_cert)) is not None:
                    assert peer_cert is not None
                    self.refuse(*refused, serial=f"{peer_cert.serial_number:x}")
                    raise HandshakeError(refused[1])
                offer_raw = self.raw_dialer is not None
                session_id = os.urandom(16)
                striping = True  # every session is marked: its express connection and any lanes join it
                async with grpc.aio.secure_channel(address, credentials(), options=options) as channel:
                    # Raw bytes both ways: messages are (de)serialized by the session itself.
                    call = channel.stream_stream(LINK_METHOD)()
                    hello = self.hello(
                        lanes=striping, session_id=session_id, raw_link=RAW_LINK_VERSION if offer_raw else 0
                    )
                    await call.write(hello.SerializeToString())
                    raw = await asyncio.wait_for(call.read(), HANDSHAKE_TIMEOUT_S)
                    if raw is grpc.aio.EOF:
                        raise HandshakeError("peer closed the link during the handshake")
                    # TLS already verified the server's certificate names the expected peer
                    # (target-name override); the handshake must agree with it.
                    try:
                        reply = parse_link_message(raw)
                        self.check_hello(reply, self.expected_peer)
                    except HandshakeError as exc:
                        self.refuse("handshake", str(exc))
                        raise
                    use_raw = bool(reply.hello.raw_link)
                    if use_raw != offer_raw:
                        reason = carrier_mismatch(ours=offer_raw, peer_offers=use_raw)
                        self.refuse("transport", reason)
                        raise HandshakeError(reason)
                    if not use_raw:
                        backoff = 0.2
                        marking = striping and reply.hello.lanes and reply.hello.session_id == session_id

                        async def open_grpc_lane(
                            index: int, session_id: bytes = session_id
                        ) -> tuple[Closeable, asyncio.Task[None]]:
                            return await self._open_lane(index, address, credentials, options, session_id)

                        try:
                            await self._dialer_session(
                                call.read,
                                grpc_writer(call.write),
                                peer_cert,
                                reply,
                                session_id,
                                marking,
                                open_grpc_lane,
                                "grpc",
                            )
                        finally:
                            call.cancel()
                    else:
                        call.cancel()  # the peer takes records: this call carried only the offer
                if use_raw:
                    await self._dial_raw_session(session_id, striping)
                    backoff = 0.2
            except asyncio.CancelledError:
                raise
            except (grpc.aio.AioRpcError, HandshakeError, TimeoutError, OSError) as exc:
                if isinstance(exc, ssl.SSLError):
                    self.refuse("tls", f"peer's TLS certificate refused: {exc}")
                detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                log.warning("cannot link to peer at %s: %s (retry in %.1fs)", address, detail, backoff)
            raise_if_cancelling()  # a stop that reached a finishing wait_for (Python 3.11) ends here
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _dialer_session(
        self,
        read: ReadFn,
        write: WriteFn,
        peer_cert: x509.Certificate | None,
        reply: link_pb2.LinkMessage,
        session_id: bytes,
        marking: bool,
        open_lane: LaneOpenFn,
        transport: str,
    ) -> None:
        """Run the dialer's session on its first connection, with the lane manager beside it."""
        session = asyncio.create_task(
            self.run_session(
                read,
                write,
                self.expected_peer,
                "dialer",
                peer_cert,
                session_id=session_id,
                marking=marking,
                transport=transport,
                peer_witness=reply.hello.audit_witness,
                peer_paced=reply.hello.paced,
                express=reply.hello.express,
            ),
            name="link-session",
        )
        manager = None
        if marking:
            manager = asyncio.create_task(self._manage_lanes(open_lane, session_id), name="link-lanes")
        try:
            await session
        finally:
            if manager is not None:
                manager.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await manager
            if not session.done():  # we were cancelled: let the session wind down first
                session.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await session

    async def _raw_connect(
        self, session_id: bytes, lane: int
    ) -> tuple[RawConnectionLike, link_pb2.LinkMessage]:
        """A raw connection whose peer passed every check of the gRPC link, after the link handshake.

        TLS verified the chain and the DNS name; here the certificate must name the expected peer
        switch and not be revoked, and the handshake must agree with it (each refusal audited).
        """
        assert self.raw_dialer is not None
        try:
            connection = await self.raw_dialer()
        except (ssl.SSLError, TlsHandshakeError) as exc:  # ssl's handshake, or pyOpenSSL's (sealed offer)
            self.refuse("tls", f"peer's TLS certificate refused on the raw link: {exc}")
            raise
        except SealedRecordError as exc:  # the sealed-records negotiation inside TLS (e.g. an old peer)
            self.refuse("transport", str(exc))
            raise
        except PreambleError as exc:
            self.refuse("transport", str(exc))
            raise
        try:
            cert = connection.peer_cert
            serial = f"{cert.serial_number:x}" if cert is not None else ""
            try:
                self.check_identity(raw_peer_identity(cert, "peer"))
            except PermissionError as exc:
                self.refuse("identity", str(exc), serial=serial)
                raise HandshakeError(str(exc)) from exc
            if (refused := self.refusal(cert)) is not None:
                self.refuse(*refused, serial=serial)
                raise HandshakeError(refused[1])
            hello = self.hello(
                lanes=True,
                session_id=session_id,
                lane=lane,
                raw_link=RAW_LINK_VERSION,
                raw_preamble=connection.preamble,
            )
            await connection.write(hello.SerializeToString())
            raw = await asyncio.wait_for(connection.read(), HANDSHAKE_TIMEOUT_S)
            if raw is grpc.aio.EOF:
                raise HandshakeError(f"peer closed raw connection {lane} during the handshake")
            try:
                reply = parse_link_message(raw)
                self.check_hello(reply, self.expected_peer)
            except HandshakeError as exc:
                self.refuse("handshake", str(exc), serial=serial)
                raise
            if reply.hello.raw_preamble != connection.preamble:
                reason = (
                    f"the raw link preamble was rewritten on path: sent {connection.preamble!r}, the peer "
                    f"confirms {reply.hello.raw_preamble!r} inside TLS"
                )
                self.refuse("transport", reason, serial=serial)
                raise PreambleError(reason)
        except BaseException:
            await connection.close()
            raise
        return connection, reply

    async def _dial_raw_session(self, session_id: bytes, striping: bool) -> None:
        """The session over a raw connection (its lanes raw too).

        The peer agreed to the raw transport inside the authenticated gRPC handshake, so a raw connection
        that cannot start (a rewritten preamble, a path that drops it) is an error to retry, never a
        reason to run the gRPC link instead: nothing said in clear chooses the transport.
        """
        try:
            connection, reply = await self._raw_connect(session_id, 0)
        except (HandshakeError, TimeoutError, OSError) as exc:
            raise HandshakeError(f"raw link connection failed: {exc}") from exc
        marking = striping and reply.hello.lanes and reply.hello.session_id == session_id

        async def open_raw_lane(index: int) -> tuple[Closeable, asyncio.Task[None]]:
            lane, _ = await self._raw_connect(session_id, index)
            return lane, asyncio.create_task(
                self.run_lane(index, lane.read, lane.write, session_id), name=f"link-lane-{index}"
            )

        try:
            await self._dialer_session(
                connection.read,
                connection.write,
                connection.peer_cert,
                reply,
                session_id,
                marking,
                open_raw_lane,
                connection.transport,
            )
        finally:
            await connection.close()

    async def _open_lane(
        self,
        index: int,
        address: str,
        credentials: CredentialsFn,
        options: list[tuple[str, object]],
        session_id: bytes,
    ) -> tuple[Closeable, asyncio.Task[None]]:
        """Dial one more connection (a channel of its own: distinct arguments, its own TCP connection)."""
        lane_options = [*options, ("grpc.use_local_subchannel_pool", 1), ("nebula.link_lane", index)]
        channel = grpc.aio.secure_channel(address, credentials(), options=lane_options)
        try:
            call = channel.stream_stream(LINK_METHOD)()
            await call.write(self.hello(session_id=session_id, lane=index).SerializeToString())
            raw = await asyncio.wait_for(call.read(), HANDSHAKE_TIMEOUT_S)
            if raw is grpc.aio.EOF:
                raise HandshakeError(f"peer refused connection {index} of the link")
            reply = parse_link_message(raw)
            self.check_hello(reply, self.expected_peer)
        except BaseException:
            await channel.close()
            raise
        return channel, asyncio.create_task(
            self.run_lane(index, call.read, grpc_writer(call.write), session_id), name=f"link-lane-{index}"
        )
