"""RawConnection: whole messages as plain records (the edge socket's) and as sealed records after real
mutual TLS 1.3 (the link's: real certificates of a local PKI, ``tests/support/raw_tls.py``), on real
sockets. The handshake's accept and refuse decisions are ``tests/unit/test_sealed_identity.py``'s.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable

import grpc
import pytest

from nebula_common.pki import init_pki
from nebula_common.pki.service_identity import ServiceTlsFiles, ensure_service_certificates, service_tls_dir
from nebula_common.rpc.blocking_steps import in_thread
from nebula_common.rpc.exporter_tls import handshake
from nebula_common.rpc.internal_tls import server_name
from nebula_common.rpc.raw_record_bounds import READ_AHEAD
from nebula_common.rpc.raw_records import RawConnection, RawConnectionError
from nebula_common.rpc.sealed_negotiation import negotiate_acceptor, negotiate_dialer
from tests.support.raw_tls import (
    openssl_client_context,
    openssl_server_context,
)

DEADLINE_S = 60.0
SEALED = pytest.mark.parametrize("sealed", [False, True], ids=["plain-records", "sealed-records"])


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


async def _pair(
    identities: dict[str, ServiceTlsFiles], *, sealed: bool, views: bool = True
) -> tuple[RawConnection, RawConnection]:
    """A connected (client, server) pair on this loop: plain records on a socket pair (what the switch's
    edge socket carries), or with ``sealed`` the link's construction: mutual TLS 1.3 through pyOpenSSL,
    the sealed-records negotiation (``nebula_common/rpc/sealed_negotiation.py``), then sealed records on
    the bare sockets."""
    left, right = socket.socketpair()
    loop = asyncio.get_running_loop()
    if not sealed:
        return RawConnection(left, "server", loop, views=views), RawConnection(
            right, "client", loop, views=views
        )
    for sock in (left, right):
        sock.settimeout(10)
    server_files, client_files = identities["switch-a"], identities["trainer-a"]
    contexts = {
        False: openssl_server_context(str(server_files.cert), str(server_files.key), str(server_files.ca)),
        True: openssl_client_context(str(client_files.cert), str(client_files.key), str(client_files.ca)),
    }

    def connection(sock: socket.socket, peer: str, dialer: bool) -> RawConnection:
        deadline = time.monotonic() + 10
        name = server_name("switch", "a") if dialer else None
        conn, cert = handshake(sock, contexts[dialer], server_name=name, deadline=deadline)
        negotiate = negotiate_dialer if dialer else negotiate_acceptor
        carrier, sealing = negotiate(conn, sock, deadline)
        return RawConnection(carrier, peer, loop, views=views, sealing=sealing, peer_cert=cert)

    accepted, dialed = await asyncio.gather(
        in_thread(lambda: connection(right, "client", False), "test-accept"),
        in_thread(lambda: connection(left, "server", True), "test-dial"),
    )
    assert dialed.peer_cert is not None and accepted.peer_cert is not None
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
        client, server = await _pair(identities, sealed=sealed)

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
        client, server = await _pair(identities, sealed=sealed)
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
        client, server = await _pair(identities, sealed=sealed)
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


def test_a_connection_cut_inside_a_message_is_an_error_not_an_end() -> None:
    async def body() -> None:
        peer, right = socket.socketpair()
        server = RawConnection(right, "client", asyncio.get_running_loop())
        # A record that promises 1 MiB, then the connection ends.
        await in_thread(lambda: peer.sendall((1 << 20).to_bytes(4, "big") + b"x" * 1000), "test-send")
        peer.shutdown(socket.SHUT_WR)
        with pytest.raises(RawConnectionError, match="ended inside a record"):
            await server.read()
        with pytest.raises(RawConnectionError):  # and it stays failed
            await server.read()
        peer.close()
        await server.close()

    _run(body)


@SEALED
def test_a_write_after_close_and_an_oversized_message_are_refused(
    identities: dict[str, ServiceTlsFiles], sealed: bool
) -> None:
    async def body() -> None:
        client, server = await _pair(identities, sealed=sealed)
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


def test_the_raw_records_module_still_exports_what_moved_to_its_parts() -> None:
    """Callers of the one-module raw records keep working: each name is the part's own object, not a copy."""
    from nebula_common.rpc import blocking_steps, raw_io_thread, raw_record_bounds, raw_records

    for module in (blocking_steps, raw_io_thread, raw_record_bounds):
        for name in raw_records.__all__:
            if hasattr(module, name):
                assert getattr(raw_records, name) is getattr(module, name), name
    assert set(raw_records.__all__) <= set(dir(raw_records))
    assert issubclass(raw_records.RawConnection, raw_io_thread.RawIoThread)
