"""The cluster ranks' rank store behind mutual TLS, and the trainer's signature on every stage it posts.

torch's ``TCPStore`` has no authentication: whoever reaches its port reads and writes every key,
including the stage specs the workers execute. So the trainer's store listens on loopback only, and
the address the workers are given (``NEBULA_TRAINER_RANKS_LISTEN``) is a ``RankGate``: TLS 1.3 with a
client certificate of this cluster's CA, role ``worker`` (``spiffe://nebula/cluster/<id>/worker``), not
revoked, and only then a byte pipe to the store. A worker reaches it through a ``RankTunnel``: a
loopback port of its own whose connections go out as TLS with the worker's certificate, to a server
that must prove it is this cluster's trainer. A stranger on the port gets no handshake and no key.

A worker runs job code, which can read the worker's key; so a worker's certificate must not be
enough to make the other workers run something. Every spec the trainer posts carries its signature
(ECDSA P-256 with the trainer's service key, over the stage number, the owner and the spec's digest)
and the trainer's certificate; a worker runs a spec only when that certificate chains to its cluster
CA, names this cluster's trainer, and the signature holds (``verify_spec``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import logging
import ssl
import threading
from collections.abc import Callable
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from nebula_common.pki import Identity, identity_from_certificate
from nebula_common.pki.mutual_tls import MutualTls, PeerAuthError, ReloadingContext
from nebula_common.pki.service_identity import WORKER_ROLE, ServiceTlsFiles
from nebula_common.rpc.internal_tls import server_name

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0
SPEC_CONTEXT = b"nebula rank stage spec v1\x00"
"""Domain separation: this signature means "the trainer posted this spec as stage n for owner"."""


RankAuthError = PeerAuthError
"""A rank connection or a posted spec that is not this cluster's trainer's or workers'."""
RankTls = MutualTls
"""One side's TLS material: its own identity's files, the cluster, and the CA's revoked serials."""


class _Pipes:
    """An event loop on a thread of its own, serving one listening socket by piping each connection."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def serve(self, handler: Callable[..., object], host: str | None, port: int) -> int:
        """Serve ``handler(reader, writer)`` per connection (plain TCP); the port listened on."""

        async def start() -> asyncio.base_events.Server:
            return await asyncio.start_server(handler, host, port)  # type: ignore[arg-type]

        return self._listen(start)

    def serve_protocol(self, factory: Callable[[], asyncio.Protocol], host: str | None, port: int) -> int:
        async def start() -> asyncio.base_events.Server:
            return await asyncio.get_running_loop().create_server(factory, host, port)

        return self._listen(start)

    def _listen(self, start: Callable[[], Any]) -> int:
        self._server = asyncio.run_coroutine_threadsafe(start(), self.loop).result(30)
        return int(self._server.sockets[0].getsockname()[1])

    def stop_listening(self) -> None:
        """Accept no new connection (on the loop's thread; the ones accepted go on)."""
        if self._server is not None:
            self._server.close()

    def close(self) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            # Awaited, so each connection's pumps end here, not as pending tasks of a stopped loop.
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _splice(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter], b: tuple[asyncio.StreamReader, asyncio.StreamWriter]
) -> None:
    """Both directions until either side ends; then both are closed."""
    await asyncio.gather(_pump(a[0], b[1]), _pump(b[0], a[1]))


class _Paused(asyncio.Protocol):
    """Takes a new connection with reading paused: its first bytes wait in the kernel for TLS."""

    def __init__(self, gate: RankGate) -> None:
        self._gate = gate

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.pause_reading()
        self._gate.accepted(transport)


class RankGate:
    """The trainer's side: TLS on ``listen`` for workers of this cluster, piped to the loopback store.

    Every refusal (no TLS, no or a wrong certificate, a revoked one) is logged with its reason.
    """

    def __init__(self, listen: str, store_port: int, tls: RankTls) -> None:
        host, _, port = listen.rpartition(":")
        self._tls = tls
        self._contexts = ReloadingContext(tls)
        self._store_port = store_port
        self._tasks: set[asyncio.Task[None]] = set()
        self._pipes = _Pipes("rank-gate")
        self.port = self._pipes.serve_protocol(lambda: _Paused(self), host.strip("[]") or None, int(port))

    def accepted(self, transport: asyncio.Transport) -> None:
        task = asyncio.get_running_loop().create_task(self._serve(transport))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, transport: asyncio.Transport) -> None:
        loop = asyncio.get_running_loop()
        peer = transport.get_extra_info("peername")
        reader = asyncio.StreamReader()
        protocol = asyncio.StreamReaderProtocol(reader)
        try:
            secured = await loop.start_tls(
                transport,
                protocol,
                self._contexts.current(),
                server_side=True,
                ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S,
            )
            if secured is None:
                raise RankAuthError("the connection closed during the handshake")
            identity = self._tls.check_peer(secured.get_extra_info("ssl_object"), WORKER_ROLE)
        except (RankAuthError, ssl.SSLError, OSError, TimeoutError) as exc:
            fields = {"peer": str(peer), "reason": str(exc) or type(exc).__name__}
            log.warning("rank store refused a connection", extra={"fields": fields})
            transport.abort()
            return
        protocol.connection_made(secured)
        writer = asyncio.StreamWriter(secured, protocol, reader, loop)
        log.debug("rank connection from %s (%s)", identity.uri, peer)
        try:
            store = await asyncio.open_connection("127.0.0.1", self._store_port)
        except OSError:
            writer.close()
            return
        await _splice((reader, writer), store)

    def close(self) -> None:
        self._pipes.close()


class RankTunnel:
    """The worker's side: a loopback port whose connections reach the trainer's gate as this worker.

    ``max_connections``: the port closes after that many (the worker's own store clients), so nothing
    else on the host (a stage's box shares the worker's network) reaches the store as this worker.
    """

    def __init__(self, trainer: str, tls: RankTls, max_connections: int | None = None) -> None:
        host, _, port = trainer.rpartition(":")
        self._host, self._port = host.strip("[]"), int(port)
        self._tls = tls
        self._left = max_connections
        self._pipes = _Pipes("rank-tunnel")
        self.port = self._pipes.serve(self._serve, "127.0.0.1", 0)

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(
            self._host,
            self._port,
            ssl=self._tls.context(server_side=False),
            server_hostname=server_name("trainer", self._tls.cluster_id),
            ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S,
        )
        try:
            self._tls.check_peer(writer.get_extra_info("ssl_object"), "trainer")
        except RankAuthError:
            writer.close()
            raise
        return reader, writer

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._left is not None:
            if self._left <= 0:  # accepted before the port closed: past the worker's own clients
                writer.close()
                return
            self._left -= 1
            if self._left == 0:
                self._pipes.stop_listening()
        try:
            gate = await self.connect()
        except (OSError, ssl.SSLError, RankAuthError) as exc:
            log.error("cannot reach the trainer's rank store at %s:%d: %s", self._host, self._port, exc)
            writer.close()
            return
        await _splice((reader, writer), gate)

    def close(self) -> None:
        self._pipes.close()


def _message(number: int, owner: str, spec: bytes) -> bytes:
    return SPEC_CONTEXT + f"{number}\x00{owner}\x00".encode() + hashlib.sha256(spec).digest()


def sign_spec(files: ServiceTlsFiles, number: int, owner: str, spec: bytes) -> tuple[bytes, bytes]:
    """(signature, signer certificate PEM) of stage ``number``'s spec, with the trainer's service key."""
    key = serialization.load_pem_private_key(files.key.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise RankAuthError(f"{files.key} is not an EC key")
    return key.sign(_message(number, owner, spec), ec.ECDSA(hashes.SHA256())), files.cert.read_bytes()


def verify_spec(
    ca_pem: bytes, cluster_id: str, number: int, owner: str, spec: bytes, signature: bytes, signer_pem: bytes
) -> None:
    """Raise RankAuthError unless this cluster's trainer signed exactly this stage (see the module doc)."""
    try:
        ca = x509.load_pem_x509_certificate(ca_pem)
        signer = x509.load_pem_x509_certificate(signer_pem)
        signer.verify_directly_issued_by(ca)
        identity = identity_from_certificate(signer)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise RankAuthError(f"the spec's signer is not a certificate of this cluster's CA: {exc}") from None
    if identity != Identity(cluster_id, "trainer"):
        raise RankAuthError(f"the spec is signed by {identity.uri}, not this cluster's trainer")
    now = datetime.datetime.now(datetime.UTC)
    if not signer.not_valid_before_utc <= now <= signer.not_valid_after_utc:
        raise RankAuthError("the spec's signer certificate is not valid now")
    public = signer.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey):
        raise RankAuthError("the spec's signer has no EC key")
    try:
        public.verify(signature, _message(number, owner, spec), ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise RankAuthError(f"stage {number}'s spec is not signed by this cluster's trainer") from None


__all__ = ["WORKER_ROLE", "RankAuthError", "RankGate", "RankTls", "RankTunnel", "sign_spec", "verify_spec"]
