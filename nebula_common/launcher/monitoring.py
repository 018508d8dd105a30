"""Prometheus configuration of one Nebula cluster: who is scraped, with which identity, which rules.

Every organisation runs its own Prometheus and scrapes only its own cluster (nothing crosses the
WAN). The services' ``/metrics`` name jobs and accounts, so they answer only a client certificate of
the cluster's ``monitoring`` role (``nebula_common.metrics``): each target is scraped over HTTPS with
that identity and pins the service it expects (``<service>.<cluster>.nebula.internal``). One scrape
config per target carries that pin; all of them are relabelled ``job="nebula"``, the job the
dashboard and the alert rules select. The same function writes the compose configs
(``docker/monitoring/prometheus-cluster-<c>.yml``, by ``tools/build_dashboard.py``) and the ones the
tests use for a local deployment (``described_targets`` reads a ``nebula local up`` description).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nebula_common.pki.identity import cluster_dns_domain
from nebula_common.pki.service_identity import CA_FILE, CERT_FILE, KEY_FILE

JOB = "nebula"


@dataclass(frozen=True)
class ScrapeTarget:
    """One service's ``/metrics``: where it listens, whose it is, and how to read it."""

    address: str  # host:port
    cluster: str
    service: str
    tls_dir: str | None = None  # the monitoring identity (ca.crt, service.crt, service.key); None: http

    @property
    def labels(self) -> dict[str, str]:
        return {"cluster": self.cluster, "service": self.service}


def scrape_config(target: ScrapeTarget) -> dict[str, Any]:
    """The scrape config of one target (its own, so its TLS pin is its own)."""
    config: dict[str, Any] = {
        "job_name": f"{JOB}-{target.cluster}-{target.service}",
        "metrics_path": "/metrics",
        "static_configs": [{"targets": [target.address], "labels": target.labels}],
        "relabel_configs": [{"target_label": "job", "replacement": JOB}],
    }
    if target.tls_dir is not None:
        directory = target.tls_dir.rstrip("/")
        config["scheme"] = "https"
        config["tls_config"] = {
            "ca_file": f"{directory}/{CA_FILE}",
            "cert_file": f"{directory}/{CERT_FILE}",
            "key_file": f"{directory}/{KEY_FILE}",
            "server_name": f"{target.service}.{cluster_dns_domain(target.cluster)}",
            "min_version": "TLS13",
        }
    return config


def prometheus_config(
    targets: list[ScrapeTarget], *, interval_s: float = 10.0, rule_files: list[str] | None = None
) -> dict[str, Any]:
    """A whole ``prometheus.yml``: the targets, their scrape interval and the alert rules."""
    interval = f"{interval_s:g}s"
    config: dict[str, Any] = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [scrape_config(target) for target in targets],
    }
    if rule_files:
        config["rule_files"] = list(rule_files)
    return config


def described_targets(
    description: dict[str, Any], cluster: str, host: str = "127.0.0.1"
) -> list[ScrapeTarget]:
    """The scrape targets of ``cluster`` in a ``nebula local up`` deployment description."""
    entry = description["clusters"][cluster]
    scraper = entry.get("monitoring_tls")
    targets = []
    for name, info in sorted(entry["processes"].items()):
        port = info.get("metrics_port")
        if not isinstance(port, int) or port <= 0:
            continue
        https = info.get("metrics_scheme") == "https"
        if https and not scraper:
            raise ValueError(f"{name} serves /metrics over TLS, but the description names no monitoring_tls")
        targets.append(
            ScrapeTarget(
                f"{host}:{port}",
                cluster,
                name.removesuffix(f"-{cluster}"),
                str(Path(scraper)) if https and scraper else None,
            )
        )
    return targets
