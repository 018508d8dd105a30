"""The launcher, not the services, renews internal certificates: a service holds no CA key.

A real auth service in-process with a leaf that is already due (60 s) and no CA key at all; the
launcher's renewer (``nebula_common/launcher/renewal.py``) issues the new leaf into its directory, and
the service serves it from the next handshake while a live connection keeps working. The renewer also
renews a due switch certificate, and leaves fresh leaves alone.
"""

from __future__ import annotations

import functools
from datetime import timedelta
from pathlib import Path

import pytest
from cryptography import x509
from prometheus_client import REGISTRY

from nebula_common.launcher.renewal import LeafRenewer
from nebula_common.pki import init_pki
from nebula_common.pki.lifecycle import renew_switch_certificate
from nebula_common.pki.service_identity import LAUNCHED_IDENTITIES, ensure_service_certificates
from nebula_common.proto.nebula.v1 import auth_pb2, auth_pb2_grpc
from nebula_common.rpc.internal_tls import ClientTls, internal_channel, set_process_client_tls
from nebula_common.service import identity as service_identity_runtime
from services.auth.config import AuthSettings
from tests.support.accounts import ADMIN_PASSWORD
from tests.support.servers import AuthServerThread
from tests.support.tls_probe import served_certificate
from tests.support.waiting import wait_for

_wait_for = functools.partial(wait_for, interval=0.1)

pytestmark = pytest.mark.timeout(120)


def _serial(path: Path) -> int:
    return int(x509.load_pem_x509_certificate(path.read_bytes()).serial_number)


def _renewals() -> float:
    return REGISTRY.get_sample_value("nebula_internal_certificate_renewals_total", {"service": "auth"}) or 0.0


def test_a_due_leaf_is_renewed_by_the_launcher_and_served_without_a_dropped_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service_identity_runtime, "CERT_CHECK_INTERVAL_S", 0.2)  # 5 s in services
    pki = init_pki(tmp_path / "pki", ["a", "b"])
    files = ensure_service_certificates(pki.root, "a", validity=timedelta(seconds=60))["auth"]
    first = _serial(files.cert)
    password = tmp_path / "admin-password"
    password.write_text(ADMIN_PASSWORD)
    renewals = _renewals()
    auth = AuthServerThread(
        AuthSettings(
            cluster_id="a",
            data_dir=tmp_path / "auth",
            admin_password_file=password,
            metrics_port=-1,
            internal_tls_dir=files.dir,
        )
    )
    try:
        address = f"127.0.0.1:{auth.service.ports['grpc_port']}"
        ca = pki.cluster("a").ca_cert
        login = auth_pb2.LoginRequest(username="admin", password=ADMIN_PASSWORD)
        with internal_channel(address, service="auth", tls=ClientTls("a", ca)) as channel:
            stub = auth_pb2_grpc.AuthStub(channel)
            assert stub.Login(login, timeout=10).token  # a connection on the first certificate
            LeafRenewer(pki.root, ["a"]).step()
            renewed = _serial(files.cert)
            assert renewed != first
            _wait_for(lambda: _renewals() > renewals, 30, "the service to take the renewed leaf into use")
            assert stub.Login(login, timeout=10).token  # the live connection was not dropped
        assert served_certificate(address, ca, "auth.a.nebula.internal").serial_number == renewed
    finally:
        auth.stop()
        set_process_client_tls(None)


def test_the_renewer_renews_only_what_is_due_and_the_switch_too(tmp_path: Path) -> None:
    pki = init_pki(tmp_path / "pki", ["a", "b"])
    fresh = ensure_service_certificates(pki.root, "a")
    before = {service: _serial(files.cert) for service, files in fresh.items()}
    switch = pki.cluster("a").switch_cert
    renew_switch_certificate(pki.root, "a", validity=timedelta(seconds=60))  # due at once
    due_switch = _serial(switch)
    LeafRenewer(pki.root, ["a"]).step()
    assert {service: _serial(files.cert) for service, files in fresh.items()} == before
    assert set(before) == set(LAUNCHED_IDENTITIES)  # every service and the scraper
    renewed = x509.load_pem_x509_certificate(switch.read_bytes())
    assert renewed.serial_number != due_switch
    assert renewed.not_valid_after_utc - renewed.not_valid_before_utc >= timedelta(hours=1)


def test_a_renewer_that_cannot_read_the_pki_keeps_going(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    renewer = LeafRenewer(tmp_path / "missing", ["a"])
    renewer.step()  # logged, not raised: the services keep their current leaves
    assert "cannot renew" in caplog.text
