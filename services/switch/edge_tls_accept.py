"""Admitting a TCP edge connection: mutual TLS 1.3, then only a trainer of this cluster, not revoked.

Why apart from ``edge_socket.py``: the edge socket serves the same records on a Unix socket (the same
host) or on TCP (``NEBULA_SWITCH_EDGE_SOCKET`` = host:port, Kubernetes), and only TCP needs this. The
handshake and the sealed-records negotiation (``nebula_common/rpc/edge_tls.py``) block, so they run on
threads of this module's own pool, never the event loop's default one: a flood of connections that
never finish a handshake ties up these threads only, each until its deadline or until a newer
connection pushes it out (``edge_socket.MAX_UNTICKETED``), which shuts its socket and so ends its
handshake at once.

After the handshake the client certificate must name a trainer of this cluster (the role matrix's
answer for ``Relay/IssueEdgeTicket``, as on the internal port) that the cluster CA has not revoked;
another service's certificate is told why on the sealed connection (``PERMISSION_DENIED``). The ticket
redeemed next, as on the Unix socket, decides which edge of which job opens.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from cryptography import x509

from nebula_common.auth.roles import refusal
from nebula_common.pki.identity import identity_from_certificate
from nebula_common.rpc.edge_tls import accept_edge
from nebula_common.rpc.sealed_records import RecordSealing

TICKET_METHOD = "/nebula.v1.Relay/IssueEdgeTicket"
"""The method whose role rule decides who may carry an edge on the TCP port."""


class EdgeTlsRefused(Exception):
    """The handshake failed or the peer may not carry an edge; the text says why (audited)."""


def trainer_refusal(peer: x509.Certificate, cluster_id: str, revoked: frozenset[int]) -> str | None:
    """Why ``peer`` may not carry an edge here, or None (a trainer of ``cluster_id``, not revoked)."""
    try:
        identity = identity_from_certificate(peer)
    except ValueError as exc:
        return f"client certificate: {exc}"
    if peer.serial_number in revoked:
        return f"client certificate {peer.serial_number:x} of {identity.uri} is revoked"
    if identity.cluster_id != cluster_id:
        return f"client certificate of cluster {identity.cluster_id!r}, this is {cluster_id!r}"
    return refusal(TICKET_METHOD, identity.role)


class EdgeTlsAcceptor:
    """Secures accepted TCP connections on a pool of its own (see the module doc)."""

    def __init__(
        self,
        pem: Callable[[], tuple[bytes, bytes, bytes]],
        cluster_id: str,
        revoked: Callable[[], frozenset[int]],
        workers: int,
    ) -> None:
        self._pem = pem
        self._cluster_id = cluster_id
        self._revoked = revoked
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="edge-tls")

    async def secure(
        self, conn: socket.socket, pushed_out: asyncio.Future[None], deadline: float
    ) -> tuple[socket.socket, RecordSealing, str | None]:
        """The bare socket, its sealing and why the client's certificate may not carry an edge (None: it
        may; the caller tells the peer on the sealed connection). EdgeTlsRefused if the handshake fails,
        times out or is pushed out."""
        loop = asyncio.get_running_loop()
        blocking_deadline = time.monotonic() + max(0.0, deadline - loop.time())
        work = loop.run_in_executor(self._pool, accept_edge, conn, self._pem(), blocking_deadline)
        try:
            await asyncio.wait({work, pushed_out}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():  # pushed out or cancelled: end the handshake where it blocks
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(Exception):
                    await asyncio.shield(work)
        if pushed_out.done():
            raise EdgeTlsRefused("pushed out by newer connections before its TLS handshake ended")
        try:
            bare, sealing, peer = work.result()
        except OSError as exc:
            raise EdgeTlsRefused(str(exc) or type(exc).__name__) from None
        return bare, sealing, trainer_refusal(peer, self._cluster_id, self._revoked())

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["EdgeTlsAcceptor", "EdgeTlsRefused", "trainer_refusal"]
