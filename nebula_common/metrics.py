"""The Prometheus endpoint every service serves, started and stopped the same way everywhere."""

from __future__ import annotations

from dataclasses import dataclass
from threading import Thread
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server

METRICS_DISABLED = -1


def listen_host(listen: str) -> str:
    """Host part of a ``host:port`` listen address, without IPv6 brackets."""
    host = listen.rpartition(":")[0] if ":" in listen else listen
    return host.strip("[]") or "0.0.0.0"


@dataclass
class MetricsEndpoint:
    httpd: WSGIServer
    thread: Thread

    @property
    def port(self) -> int:
        return int(self.httpd.server_port)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def start_metrics_endpoint(port: int, listen: str) -> MetricsEndpoint | None:
    """Serve /metrics on ``port`` (0 = any free port, -1 = disabled).

    Binds the same interface as the service's gRPC ``listen`` address, so a
    loopback-only service stays loopback-only and a container listening on
    0.0.0.0 can be scraped by its cluster's Prometheus.
    """
    if port == METRICS_DISABLED:
        return None
    httpd, thread = start_http_server(port, addr=listen_host(listen))
    return MetricsEndpoint(httpd=httpd, thread=thread)
