"""``/metrics`` answers only the cluster's monitoring (or operator) identity; strangers cannot stop it.

Series name jobs and accounts, so a reader on the host must not get them. Real pieces: the service's
metrics endpoint on a real socket with TLS 1.3, certificates from a real two-cluster PKI, and the
readers the endpoint must refuse: plain HTTP, TLS without a certificate, a service of the cluster
that is not the scraper, the other cluster's scraper, a revoked scraper; and a crowd of silent
connections that must not keep the scraper out.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from prometheus_client import Counter

from nebula_common.metrics import (
    MAX_CONNECTIONS,
    MetricsEndpoint,
    MetricsReadError,
    read_metrics,
    start_metrics_endpoint,
    trust_metrics_endpoint,
)
from nebula_common.pki import PkiLayout
from nebula_common.pki.mutual_tls import MutualTls
from nebula_common.pki.service_identity import ServiceTlsFiles, ensure_service_certificates

pytestmark = pytest.mark.timeout(120)
SECRET_SERIES = Counter("nebula_test_tenant_secret", "A series naming a tenant.", ["account"])
SECRET_SERIES.labels("alice-private-account").inc()


@pytest.fixture(scope="module")
def identities(pki_ab: PkiLayout) -> dict[str, ServiceTlsFiles]:
    a = ensure_service_certificates(pki_ab.root, "a")
    b = ensure_service_certificates(pki_ab.root, "b")
    return {
        "switch": a["switch"],
        "trainer": a["trainer"],
        "monitoring": a["monitoring"],
        "b": b["monitoring"],
    }


@pytest.fixture
def revoked() -> set[int]:
    return set()


@pytest.fixture
def endpoint(identities: dict[str, ServiceTlsFiles], revoked: set[int]) -> Iterator[MetricsEndpoint]:
    tls = MutualTls(identities["switch"], "a", lambda: frozenset(revoked))
    running = start_metrics_endpoint(0, "127.0.0.1:0", tls)
    assert running is not None and running.scheme == "https"
    yield running
    running.stop()


def _get(port: int, files: ServiceTlsFiles | None, cluster: str = "a") -> tuple[int, str]:
    """One GET /metrics with ``files`` as the client identity (None: no certificate)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.load_verify_locations(cafile=str((files or ServiceTlsFiles.in_dir(_ca_dir(cluster))).ca))
    if files is not None:
        context.load_cert_chain(str(files.cert), str(files.key))
    chunks = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, context.wrap_socket(raw) as tls:
        tls.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        while chunk := tls.recv(65536):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


_CA_DIRS: dict[str, Path] = {}


def _ca_dir(cluster: str) -> Path:
    return _CA_DIRS[cluster]


@pytest.fixture(autouse=True)
def _remember_ca(identities: dict[str, ServiceTlsFiles]) -> None:
    _CA_DIRS["a"] = identities["switch"].dir
    _CA_DIRS["b"] = identities["b"].dir


def test_the_cluster_scraper_reads_every_series(
    endpoint: MetricsEndpoint, identities: dict[str, ServiceTlsFiles]
) -> None:
    status, body = _get(endpoint.port, identities["monitoring"])
    assert status == 200 and "alice-private-account" in body


def test_readers_without_the_scraper_identity_get_nothing(
    endpoint: MetricsEndpoint, identities: dict[str, ServiceTlsFiles], revoked: set[int]
) -> None:
    # Plain HTTP on the TLS port: no exposition text, whatever comes back.
    url = f"http://127.0.0.1:{endpoint.port}/metrics"
    with (
        pytest.raises((OSError, http.client.HTTPException)),
        urllib.request.urlopen(url, timeout=10) as response,
    ):
        assert b"alice" not in response.read()
    # TLS without a client certificate: the handshake is refused.
    with pytest.raises((ssl.SSLError, ConnectionError)):
        _get(endpoint.port, None)
    # The cluster's trainer holds a certificate of the same CA, but is not the scraper.
    status, body = _get(endpoint.port, identities["trainer"])
    assert status == 403 and "alice" not in body and "cluster/a/monitoring" in body
    # The other cluster's scraper: its CA is not this cluster's.
    with pytest.raises((ssl.SSLError, ConnectionError)):
        _get(endpoint.port, identities["b"], cluster="b")
    # A revoked scraper.
    cert = x509.load_pem_x509_certificate(identities["monitoring"].cert.read_bytes())
    revoked.add(cert.serial_number)
    status, body = _get(endpoint.port, identities["monitoring"])
    assert status == 403 and "revoked" in body and "alice" not in body


def test_silent_strangers_do_not_keep_the_scraper_out(
    endpoint: MetricsEndpoint, identities: dict[str, ServiceTlsFiles]
) -> None:
    crowd = [
        socket.create_connection(("127.0.0.1", endpoint.port), timeout=10) for _ in range(3 * MAX_CONNECTIONS)
    ]
    try:
        deadline = time.monotonic() + 30
        while True:  # the crowd holds every slot until the handshake deadline frees them
            try:
                status, body = _get(endpoint.port, identities["monitoring"])
                break
            except (ssl.SSLError, ConnectionError) as exc:
                assert time.monotonic() < deadline, f"the scraper was kept out for 30 s: {exc}"
                time.sleep(0.1)  # the next attempt, once a handshake deadline may have freed a slot
        assert status == 200 and "alice-private-account" in body
    finally:
        for each in crowd:
            each.close()


def test_read_metrics_pins_the_service_it_meant(
    endpoint: MetricsEndpoint, identities: dict[str, ServiceTlsFiles]
) -> None:
    address = f"127.0.0.1:{endpoint.port}"
    url = f"https://{address}/metrics"
    trust_metrics_endpoint(address, identities["monitoring"], "a", "switch")
    assert "alice-private-account" in read_metrics(url)
    trust_metrics_endpoint(address, identities["monitoring"], "a", "auth")  # the switch answers
    with pytest.raises(MetricsReadError, match=r"auth\.a\.nebula\.internal|hostname"):
        read_metrics(url)
    with pytest.raises(MetricsReadError, match="no monitoring identity"):
        read_metrics("https://127.0.0.1:1/metrics")
