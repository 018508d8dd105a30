"""The dialer's certificate probe returns as soon as the peer's WAN port has shown its certificate.

Seen while timing ``make test``: every switch link came up 10 s after its dialer started. The probe
(``fetch_server_certificate``, run before each dial so a revoked peer is refused) closed its TLS
connection gracefully and waited for the peer's answer; a gRPC server sends none before its HTTP/2
preface wait (``grpc.server_handshake_timeout_ms``, the switch's ``wan_handshake_timeout_s``, 10 s)
ends. So each link (re)connect, in tests and in production, waited that long for nothing.

Real parts: a gRPC aio server with the switch's mutual-TLS credentials (PKI of ``init_pki``) and a
60 s preface wait, and the probe as the dialer runs it.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from cryptography import x509

from nebula_common.pki import Identity, PkiLayout
from services.switch.link_handshake import fetch_server_certificate

pytestmark = pytest.mark.timeout(120)
PREFACE_WAIT_S = 60


async def _probe_time(pki: PkiLayout) -> tuple[float, int]:
    b, a = pki.cluster("b"), pki.cluster("a")
    server = grpc.aio.server(options=[("grpc.server_handshake_timeout_ms", PREFACE_WAIT_S * 1000)])
    credentials = grpc.ssl_server_credentials(
        [(b.switch_key.read_bytes(), b.switch_cert.read_bytes())],
        root_certificates=b.trust_bundle.read_bytes(),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    try:
        started = time.monotonic()
        cert = await fetch_server_certificate(
            f"127.0.0.1:{port}", a.switch_cert, a.switch_key, a.trust_bundle, Identity("b", "switch").dns_name
        )
        return time.monotonic() - started, cert.serial_number
    finally:
        await server.stop(0)


def test_the_probe_does_not_wait_for_the_peers_preface_timeout(pki_ab: PkiLayout) -> None:
    took, serial = asyncio.run(_probe_time(pki_ab))
    expected = x509.load_pem_x509_certificate(pki_ab.cluster("b").switch_cert.read_bytes()).serial_number
    assert serial == expected
    # A TLS handshake on loopback: well under a second even at load 30; the old graceful close took
    # the server's whole preface wait (here 60 s, or asyncio's 30 s SSL shutdown timeout).
    assert took < 10.0, f"the probe took {took:.1f} s"
