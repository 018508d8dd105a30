"""One stranger cannot crowd the genuine peer out of the WAN port (``wan_frontend.py``, ``source_limits.py``).

From another loopback address (127.0.0.2, as a host on the internet would be) the test opens 1,000
connections that say nothing, 40 that send the raw link preamble and 100 that send the first bytes of a
TLS record, each then stalling: the cheapest ways to hold one of the records carrier's 16 handshake
threads, or one of the gRPC WAN server's 64 connections, for the whole handshake timeout. Without
per-source slots they kept the genuine peer out entirely on either transport; with them the source holds
at most ``PER_SOURCE_PENDING`` + ``PER_SOURCE_RELAYED`` slots, its other connections are closed at accept
and audited as a handful of aggregated ``link.refused`` records (layer ``limit``), and the genuine
peer's mutual TLS handshake (with gRPC's WAN server behind the frontend, or the records carrier) takes
about what it takes on an idle port, while the running link keeps its session. A flood from a hundred
addresses, which fills every total, does not keep out a peer whose address passed mutual TLS before.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import ssl
import statistics
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from OpenSSL import SSL

from nebula_common.pki import Identity, PkiLayout
from services.switch.rawlink_connection import PREAMBLE
from services.switch.rawlink_dialer import dial_raw
from services.switch.source_limits import PER_SOURCE_PENDING, PER_SOURCE_RELAYED
from tests.integration.test_switch_data_plane import (  # noqa: F401  (clusters: a module fixture)
    Cluster,
    clusters,
    switch_pair,
    wait_for,
)
from tests.integration.test_switch_raw_link import _context, _pem_pair

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

STRANGER = "127.0.0.2"
IDLE, STALLED, GARBLED = 1000, 40, 100
TLS_START = b"\x16\x03\x01"  # a TLS handshake record's first bytes: relayed to gRPC, which then waits


def _handshake_seconds(address: str, context: ssl.SSLContext | SSL.Context, transport: str) -> float:
    """Seconds to a completed mutual TLS 1.3 handshake with switch b's WAN port, as switch a: with
    gRPC's WAN server (HTTP/2 by ALPN, as a gRPC channel) or the records carrier."""
    if isinstance(context, ssl.SSLContext):
        host, _, port = address.rpartition(":")
        started = time.perf_counter()
        sock = socket.create_connection((host, int(port)), timeout=30)
        with context.wrap_socket(sock, server_hostname=Identity("b", "switch").dns_name):
            return time.perf_counter() - started

    assert transport == "records"

    async def once() -> float:
        started = time.perf_counter()
        connection = await dial_raw(address, context, Identity("b", "switch").dns_name, timeout=30)
        elapsed = time.perf_counter() - started
        await connection.close()
        return elapsed

    return asyncio.run(once())


def _closed_by_peer(sock: socket.socket) -> bool:
    """True once the other end has closed ``sock`` (EOF or reset), without waiting."""
    poller = select.poll()  # descriptors above 1024 here: select() cannot take them
    poller.register(sock, select.POLLIN)
    if not poller.poll(0):
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _stranger_connections(port: int) -> list[socket.socket]:
    sockets = []
    for index in range(IDLE + STALLED + GARBLED):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(5)
        try:
            sock.bind((STRANGER, 0))
            sock.connect(("127.0.0.1", port))
            if index < STALLED:
                sock.sendall(PREAMBLE)  # then nothing: no ClientHello
            elif index < STALLED + GARBLED:
                sock.sendall(TLS_START)  # then nothing
        except OSError:  # the port's backlog may drop a SYN now and then: a stranger retries or not
            sock.close()
            continue
        sockets.append(sock)
    return sockets


def _genuine_peer(tmp_path: Path, pki_ab: PkiLayout, transport: str) -> ssl.SSLContext | SSL.Context:
    """Switch a's own mutual-TLS client context (its certificate and trust bundle), as its link dials."""
    paths = pki_ab.cluster("a")
    if transport == "records":
        return _context(
            _pem_pair(
                x509.load_pem_x509_certificate(paths.switch_cert.read_bytes()),
                load_pem_private_key(paths.switch_key.read_bytes(), password=None),
            ),
            paths.trust_bundle,
        )
    genuine = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    genuine.minimum_version = ssl.TLSVersion.TLSv1_3
    genuine.load_verify_locations(cafile=str(paths.trust_bundle))
    genuine.load_cert_chain(str(paths.switch_cert), str(paths.switch_key))
    genuine.set_alpn_protocols(["h2"])
    return genuine


@pytest.mark.parametrize("transport", ["grpc", "records"])
def test_one_source_cannot_crowd_out_the_genuine_peer(
    tmp_path: Path,
    pki_ab: PkiLayout,
    clusters: dict[str, Cluster],  # noqa: F811
    transport: str,
) -> None:
    genuine = _genuine_peer(tmp_path, pki_ab, transport)
    with switch_pair(tmp_path, pki_ab, clusters, link_carrier=transport) as pair:
        frontend = pair.b.running.frontend
        assert frontend is not None
        port = pair.b.running.wan_port
        address = f"127.0.0.1:{port}"
        sessions = pair.a.running.link.state.sessions
        idle = statistics.median(_handshake_seconds(address, genuine, transport) for _ in range(5))
        strangers = _stranger_connections(port)
        try:
            assert len(strangers) >= IDLE // 2, f"only {len(strangers)} stranger connections were made"
            wait_for(
                lambda: any(
                    r["details"]["layer"] == "limit" and r["details"].get("source") == STRANGER
                    for r in pair.audit("b", "link.refused")
                ),
                30,
                "the stranger's connections over its slots refused and audited",
            )
            # Measured once the switch has dealt with the whole burst: its last connection, over the
            # stranger's slots, was closed at accept.
            wait_for(lambda: _closed_by_peer(strangers[-1]), 30, "the stranger's last connection closed")
            attacked = statistics.median(_handshake_seconds(address, genuine, transport) for _ in range(5))
            assert attacked <= 2 * idle + 0.25, (
                f"handshake {attacked:.3f} s under the flood, {idle:.3f} s idle"
            )
            held = frontend.limits.held_by(STRANGER)
            assert held <= PER_SOURCE_PENDING + PER_SOURCE_RELAYED, f"the stranger holds {held} slots"
            print(
                f"{transport}: handshake idle {idle:.4f} s, flooded {attacked:.4f} s; stranger: "
                f"{len(strangers)} connections, {held} slots held"
            )
            assert pair.a.running.link.connected and pair.a.running.link.state.sessions == sessions
        finally:
            for sock in strangers:
                with contextlib.suppress(OSError):
                    sock.close()
        refusals = [r for r in pair.audit("b", "link.refused") if r["details"].get("source") == STRANGER]
        assert 1 <= len(refusals) <= 10, f"{len(refusals)} refusal records for one stranger"
        wait_for(lambda: frontend.limits.held_by(STRANGER) == 0, 30, "every stranger's slot released")


SOURCES, IDLE_EACH = 100, 6  # 600 idle connections: past the frontend's total of 512


def _many_sources(port: int) -> list[socket.socket]:
    """From 127.0.0.2 .. 127.0.0.101 (a botnet): six idle connections and one stalled TLS start each."""
    sockets = []
    for host in range(2, 2 + SOURCES):
        for index in range(IDLE_EACH + 1):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.settimeout(5)
            try:
                sock.bind((f"127.0.0.{host}", 0))
                sock.connect(("127.0.0.1", port))
                if index == IDLE_EACH:
                    sock.sendall(TLS_START)  # relayed to gRPC, then nothing
            except OSError:
                sock.close()
                continue
            sockets.append(sock)
    return sockets


@pytest.mark.faults  # a crowd of strangers at the WAN port (`make test-faults`)
def test_many_sources_cannot_crowd_out_a_peer_that_authenticated_before(
    tmp_path: Path,
    pki_ab: PkiLayout,
    clusters: dict[str, Cluster],  # noqa: F811
) -> None:
    """A flood from a hundred addresses fills the frontend's total and would fill gRPC's connection cap;
    the peer's address, known since its link passed mutual TLS, still gets in as fast as on an idle port."""
    genuine = _genuine_peer(tmp_path, pki_ab, "grpc")
    with switch_pair(tmp_path, pki_ab, clusters, link_carrier="grpc") as pair:
        frontend = pair.b.running.frontend
        assert frontend is not None
        port = pair.b.running.wan_port
        address = f"127.0.0.1:{port}"
        # The link's connection outlives the WAN handshake timeout (10 s): its address is known.
        wait_for(lambda: frontend.limits.trusted("127.0.0.1"), 30, "the peer's address known")
        sessions = pair.a.running.link.state.sessions
        idle = statistics.median(_handshake_seconds(address, genuine, "grpc") for _ in range(5))
        strangers = _many_sources(port)
        try:
            assert len(strangers) >= SOURCES * IDLE_EACH * 0.9, f"only {len(strangers)} connections made"
            wait_for(
                lambda: any(
                    "all addresses" in r["details"]["reason"] for r in pair.audit("b", "link.refused")
                ),
                30,
                "the flood over the total refused and audited",
            )
            wait_for(lambda: _closed_by_peer(strangers[-2]), 30, "the flood's last connections dealt with")
            attacked = statistics.median(_handshake_seconds(address, genuine, "grpc") for _ in range(5))
            assert attacked <= 2 * idle + 0.25, (
                f"handshake {attacked:.3f} s under the flood, {idle:.3f} s idle"
            )
            untrusted = frontend.limits.held - frontend.limits.held_by("127.0.0.1")
            assert untrusted <= 512, f"the flood holds {untrusted} slots"
            print(
                f"many sources: handshake idle {idle:.4f} s, flooded {attacked:.4f} s; {untrusted} slots held"
            )
            assert pair.a.running.link.connected and pair.a.running.link.state.sessions == sessions
        finally:
            for sock in strangers:
                with contextlib.suppress(OSError):
                    sock.close()
