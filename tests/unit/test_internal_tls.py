"""Internal TLS of one real service (auth, in-process): ports, client certificates, roles, audit.

Real gRPC, real TLS, real certificates from a real cluster CA; the service is started exactly as
its process starts it, with ``NEBULA_AUTH_INTERNAL_TLS_DIR`` pointing at its issued identity.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nebula_common.pki import PkiLayout, init_pki
from nebula_common.pki.lifecycle import issue_leaf, revoke_certificate
from nebula_common.pki.service_identity import ServiceTlsFiles, ensure_service_certificates
from nebula_common.proto.nebula.v1 import auth_pb2, auth_pb2_grpc
from nebula_common.rpc import internal_tls
from nebula_common.rpc.internal_tls import (
    ClientTls,
    InternalTlsError,
    internal_channel,
    set_process_client_tls,
)
from nebula_common.service import identity as service_identity_runtime
from services.auth.config import AuthSettings
from tests.support.accounts import ADMIN_PASSWORD
from tests.support.servers import AuthServerThread

pytestmark = pytest.mark.timeout(120)


@dataclass
class Setup:
    pki: PkiLayout
    services: dict[str, ServiceTlsFiles]
    auth: AuthServerThread
    data_dir: Path

    @property
    def client_port(self) -> str:
        return f"127.0.0.1:{self.auth.service.ports['grpc_port']}"

    @property
    def service_port(self) -> str:
        return f"127.0.0.1:{self.auth.service.ports['service_port']}"

    def as_service(self, service: str) -> ClientTls:
        return ClientTls.for_service(self.services[service], "a")

    @property
    def user(self) -> ClientTls:
        return ClientTls("a", self.pki.cluster("a").ca_cert)

    def refusals(self) -> list[dict]:
        lines = (self.data_dir / "audit.log").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        return [r for r in records if r.get("event") == "auth.refused"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("internal-tls")
    pki = init_pki(root / "pki", ["a", "b"])
    services = ensure_service_certificates(root / "pki", "a")
    password = root / "admin-password"
    password.write_text(ADMIN_PASSWORD)
    data_dir = root / "auth"
    settings = AuthSettings(
        cluster_id="a",
        data_dir=data_dir,
        listen="127.0.0.1:0",
        admin_password_file=password,
        metrics_port=-1,
        internal_tls_dir=services["auth"].dir,
        health_listen="127.0.0.1:0",
    )
    auth = AuthServerThread(settings)
    try:
        yield Setup(pki, services, auth, data_dir)
    finally:
        auth.stop()
        set_process_client_tls(None)  # the in-process service set its own identity as the default


def _keys(address: str, tls: ClientTls) -> auth_pb2.SigningKeys:
    with internal_channel(address, service="auth", tls=tls) as channel:
        return auth_pb2_grpc.AuthStub(channel).GetSigningKeys(auth_pb2.GetSigningKeysRequest(), timeout=10)


def _login(address: str, tls: ClientTls) -> auth_pb2.LoginResponse:
    with internal_channel(address, service="auth", tls=tls) as channel:
        return auth_pb2_grpc.AuthStub(channel).Login(
            auth_pb2.LoginRequest(username="admin", password=ADMIN_PASSWORD), timeout=10
        )


def test_plaintext_call_to_either_port_fails(setup: Setup) -> None:
    for address in (setup.client_port, setup.service_port):
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as refused:
            auth_pb2_grpc.AuthStub(channel).Login(
                auth_pb2.LoginRequest(username="admin", password="x"), timeout=5
            )
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_service_port_refuses_a_handshake_without_client_certificate(setup: Setup) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        _login(setup.service_port, setup.user)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_users_log_in_over_tls_without_a_certificate(setup: Setup) -> None:
    assert _login(setup.client_port, setup.user).token


def test_service_only_method_needs_a_service_certificate(setup: Setup) -> None:
    before = len(setup.refusals())
    with pytest.raises(grpc.RpcError) as refused:
        _keys(setup.client_port, setup.user)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "service-only" in (refused.value.details() or "")
    record = setup.refusals()[before]
    assert record["details"]["method"] == "/nebula.v1.Auth/GetSigningKeys"
    assert record["details"]["peer_identity"] == ""


def test_allowed_role_is_served_on_the_service_port(setup: Setup) -> None:
    assert _keys(setup.service_port, setup.as_service("data")).issuer == "nebula-auth/a"


def test_wrong_role_is_permission_denied_and_audited(setup: Setup) -> None:
    before = len(setup.refusals())
    with pytest.raises(grpc.RpcError) as refused:
        _login(setup.service_port, setup.as_service("trainer"))  # Login is for users only
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    record = setup.refusals()[before]
    assert record["details"]["peer_identity"] == "spiffe://nebula/cluster/a/trainer"
    assert "may not call /nebula.v1.Auth/Login" in record["details"]["reason"]


def test_operator_certificate_is_a_user(setup: Setup, tmp_path: Path) -> None:
    cert, key = issue_leaf(setup.pki.root, "a", "operator", tmp_path)
    operator = ClientTls("a", setup.pki.cluster("a").ca_cert, cert, key)
    assert _login(setup.service_port, operator).token
    with pytest.raises(grpc.RpcError) as refused:
        _keys(setup.service_port, operator)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_other_clusters_certificate_fails_the_handshake(setup: Setup, tmp_path: Path) -> None:
    foreign = ensure_service_certificates(setup.pki.root, "b", ("data",))["data"]
    with pytest.raises(grpc.RpcError) as refused:
        _keys(setup.service_port, ClientTls("a", setup.pki.cluster("a").ca_cert, foreign.cert, foreign.key))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_pins_the_service_it_meant(setup: Setup) -> None:
    """The auth port's certificate says auth; a client expecting the trainer there refuses it."""
    login = auth_pb2.LoginRequest(username="admin", password="x")
    channel = internal_channel(setup.client_port, service="trainer", tls=setup.user)
    with channel, pytest.raises(grpc.RpcError) as refused:
        auth_pb2_grpc.AuthStub(channel).Login(login, timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_without_tls_configuration_a_client_refuses_plaintext(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NEBULA_INTERNAL_PLAINTEXT", raising=False)
    monkeypatch.delenv("NEBULA_CA_CERT", raising=False)
    monkeypatch.setattr(internal_tls, "_process_tls", None)  # not the in-process auth's own identity
    with pytest.raises(InternalTlsError, match="NEBULA_INTERNAL_PLAINTEXT"):
        internal_channel("127.0.0.1:1", service="auth")


def test_service_without_tls_dir_refuses_to_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("NEBULA_INTERNAL_PLAINTEXT", raising=False)
    password = tmp_path / "admin-password"
    password.write_text(ADMIN_PASSWORD)
    settings = AuthSettings(
        cluster_id="a", data_dir=tmp_path / "auth", admin_password_file=password, metrics_port=-1
    )
    with pytest.raises(InternalTlsError, match="NEBULA_AUTH_INTERNAL_TLS_DIR: required"):
        AuthServerThread(settings)


def test_service_refuses_another_services_identity(setup: Setup, tmp_path: Path) -> None:
    password = tmp_path / "admin-password"
    password.write_text(ADMIN_PASSWORD)
    settings = AuthSettings(
        cluster_id="a",
        data_dir=tmp_path / "auth",
        admin_password_file=password,
        metrics_port=-1,
        internal_tls_dir=setup.services["codec"].dir,
    )
    with pytest.raises(InternalTlsError, match="names spiffe://nebula/cluster/a/codec"):
        AuthServerThread(settings)


def test_probe_port_is_plaintext_health_only(setup: Setup) -> None:
    """For Kubernetes' native gRPC probes: health answers in plaintext, nothing else is served there."""
    address = f"127.0.0.1:{setup.auth.service.ports['health_port']}"
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="nebula.v1.Auth"), timeout=10
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as refused:
            auth_pb2_grpc.AuthStub(channel).Login(
                auth_pb2.LoginRequest(username="admin", password="x"), timeout=5
            )
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_revoked_service_certificate_is_refused_within_seconds(
    setup: Setup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`nebula pki revoke` of a service's leaf: a service given the cluster CRL refuses it at once."""
    monkeypatch.setattr(service_identity_runtime, "CERT_CHECK_INTERVAL_S", 0.2)  # 5 s in services
    password = tmp_path / "admin-password"
    password.write_text(ADMIN_PASSWORD)
    auth = AuthServerThread(
        AuthSettings(
            cluster_id="a",
            data_dir=tmp_path / "auth",
            admin_password_file=password,
            metrics_port=-1,
            internal_tls_dir=setup.services["auth"].dir,
            internal_crl=setup.pki.cluster("a").crl,
        )
    )
    try:
        address = f"127.0.0.1:{auth.service.ports['service_port']}"
        codec = setup.as_service("codec")
        assert _keys(address, codec).issuer == "nebula-auth/a"
        serial = x509.load_pem_x509_certificate(setup.services["codec"].cert.read_bytes()).serial_number
        revoke_certificate(setup.pki.root, "a", serial, reason="test")
        deadline = time.monotonic() + 20
        while True:
            try:
                _keys(address, codec)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "revoked" in (exc.details() or "")
                break
            assert time.monotonic() < deadline, "the revoked certificate was still served after 20 s"
            time.sleep(0.2)
        assert _keys(address, setup.as_service("data")).issuer == "nebula-auth/a"  # others unaffected
        records = [json.loads(line) for line in (tmp_path / "auth" / "audit.log").read_text().splitlines()]
        assert any(r["event"] == "crl.reload" and r["details"]["revoked"] == 1 for r in records)
    finally:
        auth.stop()
        set_process_client_tls(None)
