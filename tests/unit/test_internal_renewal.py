"""A service renews its own internal certificate before expiry and serves it without dropping calls.

Real auth service in-process with a leaf that is already due (60 s), the cluster CA key (the local
development set-up) and a 0.2 s check interval.
"""

from __future__ import annotations

import functools
import json
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import pytest
from cryptography import x509
from prometheus_client import REGISTRY

from nebula_common.pki import init_pki
from nebula_common.pki.service_identity import ensure_service_certificates
from nebula_common.proto.nebula.v1 import auth_pb2, auth_pb2_grpc
from nebula_common.rpc.internal_tls import ClientTls, internal_channel, set_process_client_tls
from services.auth.config import AuthSettings
from tests.support.accounts import ADMIN_PASSWORD
from tests.support.servers import AuthServerThread
from tests.support.tls_probe import served_certificate
from tests.support.waiting import wait_for

_wait_for = functools.partial(wait_for, interval=0.1)

pytestmark = pytest.mark.timeout(120)
T = TypeVar("T")


def _renewals() -> float:
    return REGISTRY.get_sample_value("nebula_internal_certificate_renewals_total", {"service": "auth"}) or 0.0


def test_due_certificate_is_renewed_and_served_while_a_connection_keeps_working(tmp_path: Path) -> None:
    pki = init_pki(tmp_path / "pki", ["a", "b"])
    files = ensure_service_certificates(tmp_path / "pki", "a", ("auth",), validity=timedelta(seconds=60))[
        "auth"
    ]
    first = x509.load_pem_x509_certificate(files.cert.read_bytes())
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
            internal_ca_key=pki.cluster("a").ca_key,
            internal_cert_check_interval_s=0.2,
        )
    )
    try:
        address = f"127.0.0.1:{auth.service.ports['grpc_port']}"
        ca = pki.cluster("a").ca_cert
        login = auth_pb2.LoginRequest(username="admin", password=ADMIN_PASSWORD)
        with internal_channel(address, service="auth", tls=ClientTls("a", ca)) as channel:
            stub = auth_pb2_grpc.AuthStub(channel)
            assert stub.Login(login, timeout=10).token  # a connection on the first certificate
            renewed = _wait_for(
                lambda: (
                    (c := x509.load_pem_x509_certificate(files.cert.read_bytes())).serial_number
                    != first.serial_number
                    and c
                ),
                30,
                "the service to renew its certificate",
            )
            _wait_for(lambda: _renewals() > renewals, 30, "the renewal to be counted")
            assert stub.Login(login, timeout=10).token  # the live connection was not dropped
        assert renewed.not_valid_after_utc - renewed.not_valid_before_utc >= timedelta(hours=1)
        # A new handshake gets the renewed certificate.
        served = served_certificate(address, ca, "auth.a.nebula.internal")
        assert served.serial_number == renewed.serial_number
        records = [json.loads(line) for line in (tmp_path / "auth" / "audit.log").read_text().splitlines()]
        renew = [r for r in records if r.get("event") == "cert.renew"]
        assert renew and renew[0]["details"]["previous_serial"] == f"{first.serial_number:x}"
    finally:
        auth.stop()
        set_process_client_tls(None)
