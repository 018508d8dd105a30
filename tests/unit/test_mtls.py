"""End-to-end checks of the WAN mutual-TLS credentials against a real grpc.aio server.

The server plays cluster b's switch; clients play a's switch and various impostors. Every
negative case must fail during the TLS handshake, so the server-side handler never runs for them.
"""

from __future__ import annotations

import asyncio
import inspect
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import grpc
import grpc.aio
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from nebula_common.pki import (
    ClusterPaths,
    Identity,
    PkiLayout,
    channel_credentials,
    channel_options,
    create_ca,
    init_pki,
    issue_certificate,
    peer_identity,
    server_credentials,
    server_options,
)

DEADLINE_S = 3.0
WHOAMI = "/nebula.test.v1.Probe/WhoAmI"
B_SWITCH = Identity("b", "switch")


@dataclass(frozen=True)
class ClientMaterial:
    """PEM blobs for building ad-hoc client credentials (good and deliberately bad ones)."""

    root_certificates: bytes
    private_key: bytes | None
    certificate_chain: bytes | None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> PkiLayout:
    # c takes part so that b trusts a CA other than a's: the rogue-CA case needs that.
    return init_pki(tmp_path_factory.mktemp("pki"), ["a", "b", "c"])


def _client(roots: bytes, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> ClientMaterial:
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return ClientMaterial(roots, key_pem, cert.public_bytes(serialization.Encoding.PEM))


def _load_ca(paths: ClusterPaths) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    ca_cert = x509.load_pem_x509_certificate(paths.ca_cert.read_bytes())
    ca_key = serialization.load_pem_private_key(paths.ca_key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    return ca_cert, ca_key


async def _whoami(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return peer_identity(context).uri.encode()


@asynccontextmanager
async def _b_switch_server(layout: PkiLayout) -> AsyncIterator[int]:
    """Run b's WAN listener (health + WhoAmI) on an ephemeral loopback port; yield the port."""
    server = grpc.aio.server(options=server_options())
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "nebula.test.v1.Probe", {"WhoAmI": grpc.unary_unary_rpc_method_handler(_whoami)}
            ),
        )
    )
    port = server.add_secure_port("127.0.0.1:0", server_credentials(layout.cluster("b")))
    assert port > 0
    await server.start()
    try:
        yield port
    finally:
        await server.stop(grace=None)


async def _call_both(
    port: int, credentials: grpc.ChannelCredentials | None, peer: Identity = B_SWITCH
) -> tuple[str, str]:
    """Health-check then WhoAmI over one channel; returns (health status, identity the server saw)."""
    target = f"127.0.0.1:{port}"
    if credentials is None:
        channel = grpc.aio.insecure_channel(target)
    else:
        channel = grpc.aio.secure_channel(target, credentials, options=channel_options(peer))
    async with channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=DEADLINE_S
        )
        seen = await channel.unary_unary(WHOAMI)(b"", timeout=DEADLINE_S)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status), seen.decode()


def _run(layout: PkiLayout, body: Callable[[int], Awaitable[object]]) -> object:
    async def scenario() -> object:
        async with _b_switch_server(layout) as port:
            return await body(port)

    return asyncio.run(scenario())


def _expect_rejected(
    layout: PkiLayout, credentials: grpc.ChannelCredentials | None, peer: Identity = B_SWITCH
) -> grpc.aio.AioRpcError:
    async def body(port: int) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as excinfo:
            await _call_both(port, credentials, peer)
        return excinfo.value

    error = _run(layout, body)
    assert isinstance(error, grpc.aio.AioRpcError)
    return error


@pytest.mark.timeout(60)
def test_peer_switch_with_proper_credentials_is_accepted(layout: PkiLayout) -> None:
    result = _run(layout, lambda port: _call_both(port, channel_credentials(layout.cluster("a"))))
    assert result == ("SERVING", "spiffe://nebula/cluster/a/switch")


@pytest.mark.timeout(60)
def test_client_without_certificate_is_rejected(layout: PkiLayout) -> None:
    a = layout.cluster("a")
    creds = ClientMaterial(a.trust_bundle.read_bytes(), None, None).credentials()
    error = _expect_rejected(layout, creds)
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error


@pytest.mark.timeout(60)
def test_client_certificate_from_unknown_ca_is_rejected(layout: PkiLayout) -> None:
    # Same identity as a's switch, but signed by a CA that b has never been told about.
    stranger_ca, stranger_key = create_ca("a")
    cert, key = issue_certificate(stranger_ca, stranger_key, Identity("a", "switch"))
    creds = _client(layout.cluster("a").trust_bundle.read_bytes(), cert, key)
    error = _expect_rejected(layout, creds.credentials())
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error


@pytest.mark.timeout(60)
def test_trusted_peer_ca_cannot_impersonate_another_cluster(layout: PkiLayout) -> None:
    # b trusts c's CA, but c's CA is name-constrained to c.nebula.internal: it cannot vouch for a.
    c_ca, c_key = _load_ca(layout.cluster("c"))
    cert, key = issue_certificate(c_ca, c_key, Identity("a", "switch"))
    creds = _client(layout.cluster("a").trust_bundle.read_bytes(), cert, key)
    error = _expect_rejected(layout, creds.credentials())
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error


@pytest.mark.timeout(60)
def test_client_expecting_a_different_peer_rejects_the_server(layout: PkiLayout) -> None:
    # a dials b's address but expects c's switch: b's certificate must fail hostname verification.
    error = _expect_rejected(layout, channel_credentials(layout.cluster("a")), Identity("c", "switch"))
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    # Unlike server-side rejections (which the client only sees as "Socket closed"), this one is
    # detected by the client itself and says so.
    assert "Hostname Verification Check failed" in (error.details() or ""), error


@pytest.mark.timeout(60)
def test_cluster_does_not_accept_its_own_switch_certificate_on_the_wan(layout: PkiLayout) -> None:
    # b's trust bundle holds only peer CAs, so even b's own valid switch certificate is refused.
    b = layout.cluster("b")
    creds = ClientMaterial(b.ca_cert.read_bytes(), b.switch_key.read_bytes(), b.switch_cert.read_bytes())
    error = _expect_rejected(layout, creds.credentials())
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error


@pytest.mark.timeout(60)
def test_expired_client_certificate_is_rejected(layout: PkiLayout) -> None:
    a_ca, a_key = _load_ca(layout.cluster("a"))
    cert, key = issue_certificate(
        a_ca,
        a_key,
        Identity("a", "switch"),
        not_before=datetime.now(UTC) - timedelta(days=3),
        validity=timedelta(days=1),
    )
    creds = _client(layout.cluster("a").trust_bundle.read_bytes(), cert, key)
    error = _expect_rejected(layout, creds.credentials())
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error


@pytest.mark.timeout(60)
def test_plaintext_client_is_rejected(layout: PkiLayout) -> None:
    error = _expect_rejected(layout, None)
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error


async def _s_client(port: int, paths: ClusterPaths, *protocol_args: str) -> tuple[int, str]:
    openssl = shutil.which("openssl")
    assert openssl is not None
    proc = await asyncio.create_subprocess_exec(
        openssl,
        "s_client",
        "-connect",
        f"127.0.0.1:{port}",
        "-servername",
        B_SWITCH.dns_name,
        "-verify_hostname",
        B_SWITCH.dns_name,
        "-CAfile",
        str(paths.trust_bundle),
        "-cert",
        str(paths.switch_cert),
        "-key",
        str(paths.switch_key),
        "-alpn",
        "h2",
        "-verify_return_error",
        *protocol_args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=20)
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl binary not installed")
def test_server_refuses_tls_1_1_and_accepts_tls_1_2(layout: PkiLayout) -> None:
    a = layout.cluster("a")

    async def body(port: int) -> tuple[tuple[int, str], tuple[int, str]]:
        # SECLEVEL=0 lets *our* OpenSSL offer TLS 1.1 at all, so a failure is the server's refusal.
        old = await _s_client(port, a, "-tls1_1", "-cipher", "DEFAULT:@SECLEVEL=0")
        new = await _s_client(port, a, "-tls1_2")
        return old, new

    result = _run(layout, body)
    assert isinstance(result, tuple)
    (old_rc, old_out), (new_rc, new_out) = result
    # The server drops the TLS 1.1 ClientHello (gRPC logs UNSUPPORTED_PROTOCOL) without negotiating
    # anything; s_client still prints "Protocol : TLSv1.1" (what it offered), so look at the cipher.
    assert old_rc != 0, old_out
    assert "no protocols available" not in old_out, old_out
    assert "Cipher is (NONE)" in old_out, old_out
    assert new_rc == 0, new_out
    assert "Protocol  : TLSv1.2" in new_out, new_out
    assert "Verify return code: 0 (ok)" in new_out, new_out


class _FakeContext:
    """Just enough of a ServicerContext for peer_identity: the auth context dict gRPC provides."""

    def __init__(self, auth: dict[str, list[bytes]]) -> None:
        self._auth = auth

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth


@pytest.mark.timeout(60)
def test_peer_identity_requires_a_verified_certificate(layout: PkiLayout) -> None:
    a = layout.cluster("a")
    ok = _FakeContext({"x509_pem_cert": [a.switch_cert.read_bytes()], "transport_security_type": [b"ssl"]})
    assert peer_identity(ok) == Identity("a", "switch")  # type: ignore[arg-type]
    with pytest.raises(PermissionError, match="no verified client certificate"):
        peer_identity(_FakeContext({}))  # type: ignore[arg-type]
    with pytest.raises(PermissionError, match="no valid Nebula identity"):
        peer_identity(_FakeContext({"x509_pem_cert": [a.ca_cert.read_bytes()]}))  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_credential_builders_offer_no_way_around_mutual_tls() -> None:
    assert list(inspect.signature(server_credentials).parameters) == ["paths"]
    options = dict(channel_options(Identity("b", "switch")))
    assert options["grpc.ssl_target_name_override"] == "switch.b.nebula.internal"
    assert options["grpc.keepalive_time_ms"] == 20_000
    assert options["grpc.keepalive_permit_without_calls"] == 1
    # The server must tolerate the client's ping rate, or it would GOAWAY with too_many_pings.
    assert dict(server_options())["grpc.http2.min_ping_interval_without_data_ms"] <= 20_000
