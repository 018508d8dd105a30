"""Unauthenticated connections to an internal TLS port are bounded in time and in number.

A real auth service (in-process, internal TLS on) with a 2 s handshake timeout and room for 60
connections; 100 idle TCP clients that never send a ClientHello. Without the bounds gRPC keeps each
one for 120 s.
"""

from __future__ import annotations

import selectors
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nebula_common.pki import init_pki
from nebula_common.pki.service_identity import ensure_service_certificates
from nebula_common.proto.nebula.v1 import auth_pb2, auth_pb2_grpc
from nebula_common.rpc.internal_tls import ClientTls, internal_channel, set_process_client_tls
from nebula_common.service import resources
from services.auth.config import AuthSettings
from tests.support.accounts import ADMIN_PASSWORD
from tests.support.servers import AuthServerThread

pytestmark = pytest.mark.timeout(120)

HANDSHAKE_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 60
IDLE_CLIENTS = 100


@pytest.fixture(scope="module")
def auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AuthServerThread, Path]]:
    root = tmp_path_factory.mktemp("handshake")
    init_pki(root / "pki", ["a", "b"])
    services = ensure_service_certificates(root / "pki", "a", ("auth",))
    password = root / "admin-password"
    password.write_text(ADMIN_PASSWORD)
    # The bounds are constants; shorter and fewer here so that the test runs in seconds.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(resources, "HANDSHAKE_TIMEOUT_S", HANDSHAKE_TIMEOUT_S)
        patch.setattr(resources, "MAX_CONNECTIONS", MAX_CONNECTIONS)
        server = AuthServerThread(
            AuthSettings(
                cluster_id="a",
                data_dir=root / "auth",
                admin_password_file=password,
                metrics_port=-1,
                internal_tls_dir=services["auth"].dir,
            )
        )
    try:
        yield server, root / "pki" / "a" / "ca.crt"
    finally:
        server.stop()
        set_process_client_tls(None)


def _closed_after(port: int, count: int, deadline_s: float) -> list[float]:
    """Open ``count`` idle connections; seconds until each was closed by the server (EOF or reset)."""
    selector = selectors.DefaultSelector()
    started = time.monotonic()
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    closed: list[float] = []
    try:
        while len(closed) < count and time.monotonic() - started < deadline_s:
            for key, _ in selector.select(timeout=0.5):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(1024)
                except (ConnectionResetError, BlockingIOError):
                    data = b""
                assert data == b"", f"the server sent {data!r} to a client that said nothing"
                closed.append(time.monotonic() - started)
                selector.unregister(sock)
                sock.close()
    finally:
        for key in list(selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        selector.close()
    return closed


@pytest.mark.parametrize("port_key", ["grpc_port", "service_port"])
def test_idle_clients_are_dropped_within_seconds(auth: tuple[AuthServerThread, Path], port_key: str) -> None:
    server, ca = auth
    closed = _closed_after(server.service.ports[port_key], IDLE_CLIENTS, deadline_s=30)
    assert len(closed) == IDLE_CLIENTS, (
        f"only {len(closed)} of {IDLE_CLIENTS} idle clients were dropped in 30 s"
    )
    # Over the cap: closed at accept. The rest: at the handshake timeout (2 s), never gRPC's 120 s.
    assert sum(t < HANDSHAKE_TIMEOUT_S * 0.75 for t in closed) >= IDLE_CLIENTS - MAX_CONNECTIONS, closed
    assert max(closed) < HANDSHAKE_TIMEOUT_S + 6, closed
    # And the port still serves a real client afterwards.
    with internal_channel(
        f"127.0.0.1:{server.service.ports['grpc_port']}", service="auth", tls=ClientTls("a", ca)
    ) as channel:
        reply = auth_pb2_grpc.AuthStub(channel).Login(
            auth_pb2.LoginRequest(username="admin", password=ADMIN_PASSWORD), timeout=10
        )
    assert reply.token
