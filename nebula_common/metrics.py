"""The Prometheus endpoint every service serves, and how Nebula's own tools read one.

Series name jobs and accounts (labels ``job_id``, ``account``), so ``/metrics`` is not for whoever
reaches the port: with internal TLS on (every deployment but the plaintext development flag) it is
HTTPS with a required client certificate of the cluster CA naming the ``monitoring`` role (the
cluster's Prometheus; ``nebula local up`` issues one into ``<run>/pki/<cluster>/services/monitoring``)
or ``operator``. The handshake checks the chain, the handler the role, the cluster and the CRL; a
refused reader gets 403 and is counted (``nebula_metrics_refusals_total``). Handshakes run on the
connection's own thread with a deadline, and at most ``MAX_CONNECTIONS`` are served at once, so a
stranger holding sockets open cannot stop the scrape.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, Counter, make_wsgi_app

from nebula_common.pki.identity import cluster_dns_domain
from nebula_common.pki.mutual_tls import MutualTls, PeerAuthError, ReloadingContext
from nebula_common.pki.service_identity import ServiceTlsFiles

METRICS_DISABLED = -1
SCRAPER_ROLES = frozenset({"monitoring", "operator"})
"""Whose certificate may read ``/metrics``: the cluster's Prometheus, or an operator."""
HANDSHAKE_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 16
_REFUSED = "nebula.metrics.refused"

METRICS_REFUSALS = Counter(
    "nebula_metrics_refusals", "Readers of /metrics refused (no or wrong certificate).", ["reason"]
)
for _reason in ("handshake", "identity", "busy"):
    METRICS_REFUSALS.labels(_reason)


def listen_host(listen: str) -> str:
    """Host part of a ``host:port`` listen address, without IPv6 brackets."""
    host = listen.rpartition(":")[0] if ":" in listen else listen
    return host.strip("[]") or "0.0.0.0"


class _Handler(WSGIRequestHandler):
    """Completes the handshake on this connection's thread, then checks who is reading."""

    server: _MetricsServer

    def handle(self) -> None:
        tls = self.server.tls
        if tls is not None:
            assert isinstance(self.connection, ssl.SSLSocket)
            try:
                self.connection.do_handshake()
            except (ssl.SSLError, OSError):
                METRICS_REFUSALS.labels("handshake").inc()
                return
            try:
                tls.check_peer(self.connection, SCRAPER_ROLES)
                self.refusal = ""
            except PeerAuthError as exc:
                METRICS_REFUSALS.labels("identity").inc()
                self.refusal = str(exc)
            self.connection.settimeout(None)
        super().handle()

    def get_environ(self) -> dict[str, Any]:
        environ = super().get_environ()
        environ[_REFUSED] = getattr(self, "refusal", "")
        return environ

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds are not log lines."""


class _MetricsServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    tls: MutualTls | None = None

    def setup_tls(self, tls: MutualTls | None) -> None:
        self.tls = tls
        self._contexts = ReloadingContext(tls) if tls is not None else None
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, address = super().get_request()
        if self._contexts is None:
            return sock, address
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        wrapped = self._contexts.current().wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return wrapped, address

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            METRICS_REFUSALS.labels("busy").inc()
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _guarded(app: Callable[..., Any]) -> Callable[..., Any]:
    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        refusal = environ.get(_REFUSED, "")
        if refusal:
            start_response("403 Forbidden", [("Content-Type", "text/plain; charset=utf-8")])
            return [f"refused: {refusal}; /metrics needs a monitoring or operator certificate\n".encode()]
        return app(environ, start_response)

    return guarded


@dataclass
class MetricsEndpoint:
    httpd: _MetricsServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.httpd.server_port)

    @property
    def scheme(self) -> str:
        return "https" if self.httpd.tls is not None else "http"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def start_metrics_endpoint(port: int, listen: str, tls: MutualTls | None = None) -> MetricsEndpoint | None:
    """Serve /metrics on ``port`` (0 = any free port, -1 = disabled); HTTPS for scrapers when ``tls``.

    Binds the same interface as the service's gRPC ``listen`` address, so a loopback-only service
    stays loopback-only and a container listening on 0.0.0.0 can be scraped by its cluster's
    Prometheus.
    """
    if port == METRICS_DISABLED:
        return None
    if tls is not None:
        ReloadingContext(tls).current()  # bad files fail the start, not the first scrape
    httpd = make_server(
        listen_host(listen), port, _guarded(make_wsgi_app(REGISTRY)), _MetricsServer, handler_class=_Handler
    )
    httpd.setup_tls(tls)
    thread = threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True)
    thread.start()
    return MetricsEndpoint(httpd=httpd, thread=thread)


# --- reading ------------------------------------------------------------------------------------

_SCRAPE_TLS: dict[str, tuple[MutualTls, str]] = {}
_SCRAPE_LOCK = threading.Lock()


def trust_metrics_endpoint(address: str, files: ServiceTlsFiles, cluster_id: str, service: str) -> None:
    """Read ``https://address/metrics`` with ``files`` (a monitoring or operator identity), pinning
    ``service`` of ``cluster_id`` as the server."""
    with _SCRAPE_LOCK:
        _SCRAPE_TLS[address] = (MutualTls(files, cluster_id), f"{service}.{cluster_dns_domain(cluster_id)}")


class MetricsReadError(OSError):
    """A ``/metrics`` endpoint that could not be read (the message says which and why)."""


def read_metrics(url: str, timeout: float = 5.0) -> str:
    """The exposition text at ``url``; ``https`` URLs with the identity registered for their address."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "http":
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read().decode()
    address = parts.netloc
    with _SCRAPE_LOCK:
        entry = _SCRAPE_TLS.get(address)
    if entry is None:
        raise MetricsReadError(f"{url}: no monitoring identity known for {address}")
    tls, name = entry
    context = tls.context(server_side=False)
    connection = http.client.HTTPSConnection(
        parts.hostname or "", parts.port, timeout=timeout, context=context
    )
    try:
        # Pin the service, not the address: its certificate names <service>.<cluster>.nebula.internal.
        raw = socket.create_connection((parts.hostname or "", parts.port or 443), timeout=timeout)
        connection.sock = context.wrap_socket(raw, server_hostname=name)
    except (OSError, ssl.SSLError) as exc:
        connection.close()
        raise MetricsReadError(f"{url}: {exc}") from None
    try:
        connection.request("GET", parts.path or "/metrics")
        response = connection.getresponse()
        body = response.read().decode()
    finally:
        connection.close()
    if response.status != 200:
        raise MetricsReadError(f"{url}: HTTP {response.status}: {body.strip()}")
    return body


def metrics_url(host: str, info: dict[str, Any]) -> str | None:
    """The ``/metrics`` URL a service's ready line announces (None: it serves none)."""
    port = info.get("metrics_port")
    if not isinstance(port, int) or port <= 0:
        return None
    return f"{info.get('metrics_scheme') or 'http'}://{host}:{port}/metrics"
