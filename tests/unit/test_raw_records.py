"""RawConnection: whole messages over real mutual TLS 1.3 on loopback (real certificates, real sockets).

Every test uses a real socket pair, real certificates of a local PKI and mutual TLS 1.3 contexts
(``tests/support/raw_tls.py``).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import Awaitable, Callable

import grpc
import pytest
from OpenSSL import SSL

from nebula_common.pki import init_pki
from nebula_common.pki.service_identity import ServiceTlsFiles, ensure_service_certificates, service_tls_dir
from nebula_common.rpc.blocking_steps import in_thread
from nebula_common.rpc.exporter_tls import handshake
from nebula_common.rpc.internal_tls import server_name
from nebula_common.rpc.raw_record_bounds import READ_AHEAD
from nebula_common.rpc.raw_records import RawConnection, RawConnectionError
from nebula_common.rpc.sealed_negotiation import negotiate_acceptor, negotiate_dialer
from tests.support.raw_tls import (
    client_context,
    openssl_client_context,
    openssl_server_context,
    server_context,
)

DEADLINE_S = 60.0
SEALED = pytest.mark.parametrize("sealed", [False, True], ids=["tls-records", "sealed-records"])


@pytest.fixture(scope="module")
def identities(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ServiceTlsFiles]:
    root = tmp_path_factory.mktemp("pki")
    init_pki(root, ["a", "b"])
    found = {}
    for cluster in "ab":
        ensure_service_certificates(root, cluster)
        for service in ("switch", "trainer"):
            found[f"{service}-{cluster}"] = ServiceTlsFiles.in_dir(service_tls_dir(root, cluster, service))
    return found


_TWINS: dict[int, tuple[ssl.SSLContext, SSL.Context]] = {}
"""Each ``ssl`` context made here with its pyOpenSSL twin (same files), for the sealed pairs."""


def _server(files: ServiceTlsFiles) -> ssl.SSLContext:
    context = server_context(str(files.cert), str(files.key), str(files.ca))
    _TWINS[id(context)] = (context, openssl_server_context(str(files.cert), str(files.key), str(files.ca)))
    return context


def _client(files: ServiceTlsFiles, cluster: str) -> ssl.SSLContext:
    context = client_context(str(files.cert), str(files.key), str(files.ca))
    _TWINS[id(context)] = (context, openssl_client_context(str(files.cert), str(files.key), str(files.ca)))
    return context


async def _pair(
    server: ssl.SSLContext, client: ssl.SSLContext, name: str, views: bool = True, sealed: bool = False
) -> tuple[RawConnection, RawConnection]:
    """A connected (client, server) pair after the TLS handshake, both on this loop; with ``sealed``
    the handshake is pyOpenSSL's (the contexts' twins) and both ask for sealed records
    (``nebula_common/rpc/sealed_negotiation.py``) after it."""
    left, right = socket.socketpair()
    for sock in (left, right):
        sock.settimeout(10)

    def connection(
        sock: socket.socket, peer: str, loop: asyncio.AbstractEventLoop, dialer: bool
    ) -> RawConnection:
        if not sealed:
            tls = (
                client.wrap_socket(sock, server_hostname=name)
                if dialer
                else server.wrap_socket(sock, server_side=True)
            )
            return RawConnection(tls, peer, loop, views=views)
        deadline = time.monotonic() + 10
        twin = _TWINS[id(client if dialer else server)][1]
        conn, cert = handshake(sock, twin, server_name=name if dialer else None, deadline=deadline)
        negotiate = negotiate_dialer if dialer else negotiate_acceptor
        carrier, sealing = negotiate(conn, sock, deadline)
        assert sealing is not None
        return RawConnection(carrier, peer, loop, views=views, sealing=sealing, peer_cert=cert)

    async def accept() -> RawConnection:
        loop = asyncio.get_running_loop()
        return await in_thread(lambda: connection(right, "client", loop, False), "test-accept")

    async def dial() -> RawConnection:
        loop = asyncio.get_running_loop()
        return await in_thread(lambda: connection(left, "server", loop, True), "test-dial")

    accepted, dialed = await asyncio.gather(accept(), dial(), return_exceptions=True)
    for connection in (dialed, accepted):
        if isinstance(connection, BaseException):
            for other in (dialed, accepted):
                if isinstance(other, RawConnection):
                    await other.close()
            raise connection  # the client's failure first: the server's follows from its alert
    assert isinstance(dialed, RawConnection) and isinstance(accepted, RawConnection)
    return dialed, accepted


def _run(body: Callable[[], Awaitable[None]]) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(body(), DEADLINE_S)

    asyncio.run(bounded())


@SEALED
def test_messages_of_every_size_arrive_whole_and_in_order_both_ways(
    identities: dict[str, ServiceTlsFiles], sealed: bool
) -> None:
    sizes = [
        0,
        1,
        4,
        16 << 10,
        (16 << 10) - 4,
        (16 << 10) - 3,
        64 << 10,
        (64 << 10) + 1,
        1 << 20,
        (3 << 20) + 7,
    ]
    messages = [
        bytes((index * 7 + i) % 251 for i in range(min(size, 997))) * (size // 997 + 1)
        for index, size in enumerate(sizes)
    ]
    messages = [message[:size] for message, size in zip(messages, sizes, strict=True)]

    async def body() -> None:
        client, server = await _pair(
            _server(identities["switch-a"]),
            _client(identities["trainer-a"], "a"),
            server_name("switch", "a"),
            sealed=sealed,
        )
        assert server.peer_cert is not None and client.peer_cert is not None

        async def send(connection: RawConnection) -> None:
            for message in messages:
                await connection.write(memoryview(message) if len(message) % 2 else message)

        async def receive(connection: RawConnection) -> list[bytes]:
            return [bytes(await connection.read()) for _ in messages]  # type: ignore[arg-type]

        got = await asyncio.gather(send(client), send(server), receive(server), receive(client))
        assert got[2] == messages
        assert got[3] == messages
        await client.close()
        assert await server.read() is grpc.aio.EOF
        assert await server.read() is grpc.aio.EOF  # every later read sees the end too
        await server.close()

    _run(body)


@SEALED
def test_a_large_message_is_handed_on_as_a_view_of_its_own_buffer(
    identities: dict[str, ServiceTlsFiles], sealed: bool
) -> None:
    async def body() -> None:
        client, server = await _pair(
            _server(identities["switch-a"]),
            _client(identities["trainer-a"], "a"),
            server_name("switch", "a"),
            sealed=sealed,
        )
        payload = bytes(range(256)) * 4096  # 1 MiB
        await client.write(payload)
        await client.write(b"small")
        first, second = await server.read(), await server.read()
        assert isinstance(first, memoryview) and first.obj is not None and bytes(first) == payload
        assert second == b"small" and isinstance(second, bytes)
        await client.close()
        await server.close()

    _run(body)


@SEALED
def test_a_slow_reader_stops_the_connection_reading_and_loses_nothing(
    identities: dict[str, ServiceTlsFiles], sealed: bool
) -> None:
    count = READ_AHEAD * 6

    async def body() -> None:
        client, server = await _pair(
            _server(identities["switch-a"]),
            _client(identities["trainer-a"], "a"),
            server_name("switch", "a"),
            sealed=sealed,
        )
        chunk = 256 << 10

        async def send() -> None:
            for index in range(count):
                await client.write(index.to_bytes(4, "big") * (chunk // 4))

        sender = asyncio.create_task(send())
        # Nobody reads: the receiver may hold READ_AHEAD messages, then TCP and the writer's bound hold
        # the rest; the sender cannot finish.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while server.pending_reads() < READ_AHEAD and loop.time() < deadline:
            await asyncio.sleep(0.01)
        assert server.pending_reads() == READ_AHEAD, f"{server.pending_reads()} messages queued"
        assert server._room == 0, "the connection still has room for messages"
        assert not sender.done()
        for index in range(count):
            message = await server.read()
            assert bytes(message[:4]) == index.to_bytes(4, "big")  # type: ignore[index]
            assert len(message) == chunk  # type: ignore[arg-type]
        await sender
        await client.close()
        await server.close()

    _run(body)


def test_a_connection_cut_inside_a_message_is_an_error_not_an_end(
    identities: dict[str, ServiceTlsFiles],
) -> None:
    async def body() -> None:
        # The peer here is a plain blocking TLS socket this test alone drives: writing through a
        # RawConnection's socket from outside its I/O thread would share one SSL object between two
        # threads (the cause of this test's one failure in CI: nothing arrived before the end).
        left, right = socket.socketpair()
        for sock in (left, right):
            sock.settimeout(10)
        server_context = _server(identities["switch-a"])
        client_context = _client(identities["trainer-a"], "a")

        async def accept() -> RawConnection:
            tls = await in_thread(lambda: server_context.wrap_socket(right, server_side=True), "test-accept")
            return RawConnection(tls, "client", asyncio.get_running_loop())

        dial = in_thread(
            lambda: client_context.wrap_socket(left, server_hostname=server_name("switch", "a")), "test-dial"
        )
        server, peer = await asyncio.gather(accept(), dial)
        # A record that promises 1 MiB, then the TCP connection ends.
        await in_thread(lambda: peer.sendall((1 << 20).to_bytes(4, "big") + b"x" * 1000), "test-send")
        socket.socket.shutdown(peer, socket.SHUT_WR)  # the TCP end, not TLS's close_notify
        with pytest.raises(RawConnectionError, match="ended inside a record"):
            await server.read()
        with pytest.raises(RawConnectionError):  # and it stays failed
            await server.read()
        peer.close()
        await server.close()

    _run(body)


def test_a_write_after_close_and_an_oversized_message_are_refused(
    identities: dict[str, ServiceTlsFiles],
) -> None:
    async def body() -> None:
        client, server = await _pair(
            _server(identities["switch-a"]), _client(identities["trainer-a"], "a"), server_name("switch", "a")
        )
        with pytest.raises(RawConnectionError, match="exceeds the raw record limit"):
            await client.write(b"\0" * ((64 << 20) + 1))
        await client.close()
        with pytest.raises(RawConnectionError, match="is closed"):
            await client.write(b"late")
        assert await server.read() is grpc.aio.EOF
        await server.close()
        with pytest.raises(RawConnectionError, match="closed by this switch"):
            await client.read()

    _run(body)


def test_the_handshake_checks_the_server_certificate(identities: dict[str, ServiceTlsFiles]) -> None:
    """A server certificate of another cluster's CA, or the wrong pinned name, fails the handshake."""

    async def body() -> None:
        with pytest.raises(ssl.SSLCertVerificationError):
            await _pair(
                _server(identities["switch-b"]),
                _client(identities["trainer-a"], "a"),
                server_name("switch", "b"),
            )
        with pytest.raises(ssl.SSLCertVerificationError):
            await _pair(
                _server(identities["switch-a"]),
                _client(identities["trainer-a"], "a"),
                server_name("auth", "a"),
            )

    _run(body)


def test_a_client_without_a_certificate_is_refused_by_the_server(
    identities: dict[str, ServiceTlsFiles],
) -> None:
    async def body() -> None:
        files = identities["trainer-a"]
        bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        bare.load_verify_locations(cafile=str(files.ca))
        with pytest.raises(ssl.SSLError, match=r"(?i)certificate"):
            await _pair(_server(identities["switch-a"]), bare, server_name("switch", "a"))

    _run(body)


def test_the_raw_records_module_still_exports_what_moved_to_its_parts() -> None:
    """Callers of the one-module raw records keep working: each name is the part's own object, not a copy."""
    from nebula_common.rpc import blocking_steps, raw_io_thread, raw_record_bounds, raw_records

    for module in (blocking_steps, raw_io_thread, raw_record_bounds):
        for name in raw_records.__all__:
            if hasattr(module, name):
                assert getattr(raw_records, name) is getattr(module, name), name
    assert set(raw_records.__all__) <= set(dir(raw_records))
    assert issubclass(raw_records.RawConnection, raw_io_thread.RawIoThread)
