"""Start the Prometheus endpoint the same way in every service."""

from __future__ import annotations

import os

from prometheus_client import start_http_server


def start_metrics_server(port: int, host: str | None = None) -> int:
    """Serve /metrics on ``port`` (0 = any free port, -1 = disabled); returns the bound port or -1.

    Binds loopback unless NEBULA_METRICS_HOST says otherwise (containers set 0.0.0.0
    so the cluster's Prometheus can scrape them).
    """
    if port < 0:
        return -1
    server, _ = start_http_server(port, addr=host or os.environ.get("NEBULA_METRICS_HOST", "127.0.0.1"))
    return int(server.server_address[1])
