"""Build docker/monitoring/nebula-dashboard.json (Grafana) from one readable panel list, and the compose
deployment's per-cluster Prometheus configs (prometheus-cluster-<c>.yml) from the product's own.

Why generated: a dashboard is hundreds of lines of JSON where the interesting
part is ten PromQL queries. Keeping those queries here, next to their titles,
makes them reviewable; `tests/integration/test_dashboards.py` (`make check-dashboards`) evaluates
every query in a real Prometheus scraping a live deployment during a job and fails on any that
returns nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # nebula_common, for the Prometheus configs
OUT = ROOT / "docker" / "monitoring" / "nebula-dashboard.json"

# (title, unit, [(PromQL, legend)], panel width)
PANELS: list[tuple[str, str, list[tuple[str, str]], int]] = [
    (
        "WAN throughput (bits/s)",
        "bps",
        [
            (
                "sum by (cluster, direction) (rate(nebula_switch_wan_bytes_total[1m])) * 8",
                "{{cluster}} {{direction}}",
            )
        ],
        12,
    ),
    (
        "Compression ratio on the WAN (raw / payload)",
        "none",
        [
            (
                'sum by (cluster) (rate(nebula_switch_wan_raw_bytes_total{direction="sent"}[5m]))'
                ' / sum by (cluster) (rate(nebula_switch_wan_payload_bytes_total{direction="sent"}[5m]))',
                "{{cluster}} sent",
            )
        ],
        12,
    ),
    ("WAN link up", "none", [("nebula_switch_link_up", "{{cluster}}")], 4),
    # Lanes the link stripes items over (0 while down): a drop from N to 1 is lost WAN throughput.
    (
        "WAN link connections (lanes)",
        "none",
        [("nebula_switch_link_connections", "{{cluster}} to {{peer}}")],
        4,
    ),
    ("Open job edges", "none", [("nebula_switch_edges_open", "{{cluster}}")], 4),
    # The paced link (services/switch/pacing.py): what the peer has not read yet, kept under the cap, so a
    # big job's bytes wait in the scheduler; unread bytes pinned at the cap mean a full link.
    (
        "WAN link: bytes the peer has not read / cap",
        "bytes",
        [
            ("nebula_switch_link_inflight_bytes", "{{cluster}} to {{peer}} unread"),
            ("nebula_switch_link_inflight_limit_bytes", "{{cluster}} to {{peer}} cap"),
        ],
        12,
    ),
    (
        "WAN link delivery rate, as the pacer estimates it (bits/s)",
        "bps",
        [("nebula_switch_link_delivery_rate_bytes * 8", "{{cluster}} to {{peer}}")],
        12,
    ),
    (
        "Frames relayed / s",
        "ops",
        [
            (
                "sum by (cluster, direction) (rate(nebula_switch_frames_relayed_total[1m]))",
                "{{cluster}} {{direction}}",
            )
        ],
        12,
    ),
    (
        "Refused calls / s (by reason)",
        "ops",
        [
            (
                "sum by (cluster, port, reason) (rate(nebula_switch_refusals_total[5m]))",
                "{{cluster}} {{port}} {{reason}}",
            )
        ],
        12,
    ),
    ("Training loss", "none", [("nebula_trainer_loss", "{{job_id}} {{stage}}")], 12),
    (
        "Step time p50 / p95",
        "s",
        [
            (
                "histogram_quantile(0.5, sum by (le, stage) (rate(nebula_trainer_step_seconds_bucket[5m])))",
                "p50 {{stage}}",
            ),
            (
                "histogram_quantile(0.95, sum by (le, stage) (rate(nebula_trainer_step_seconds_bucket[5m])))",
                "p95 {{stage}}",
            ),
        ],
        12,
    ),
    (
        "Fraction of step time waiting for the other cluster",
        "percentunit",
        [
            (
                "sum by (stage) (rate(nebula_trainer_wait_seconds_total[5m]))"
                " / sum by (stage) (rate(nebula_trainer_step_seconds_sum[5m]))",
                "{{stage}}",
            )
        ],
        12,
    ),
    (
        "Logins / s (by outcome)",
        "ops",
        [("sum by (cluster, outcome) (rate(nebula_auth_logins_total[5m]))", "{{cluster}} {{outcome}}")],
        12,
    ),
    (
        "Data service calls / s (by method, outcome)",
        "ops",
        [
            (
                "sum by (cluster, method, outcome) (rate(nebula_data_requests_total[5m]))",
                "{{cluster}} {{method}} {{outcome}}",
            ),
            ("sum by (cluster) (rate(nebula_data_records_read_total[5m]))", "{{cluster}} records read"),
        ],
        12,
    ),
    # Prometheus' own `up` per scrape target: a service missing here is not scraped at all.
    ("Services scraped (up)", "none", [('up{job="nebula"}', "{{cluster}} {{service}}")], 12),
    (
        "Certificates: days left",
        "d",
        [
            (
                "min by (cluster) (nebula_switch_certificate_expiry_seconds) / 86400",
                "{{cluster}} switch (WAN)",
            ),
            (
                "min by (cluster, service) (nebula_internal_certificate_expiry_seconds) / 86400",
                "{{cluster}} {{service}} (internal)",
            ),
        ],
        12,
    ),
    # A peer's CRL past its nextUpdate is stale: revocations the peer made since are not enforced.
    (
        "Peer CRLs: hours until stale",
        "h",
        [
            (
                "(nebula_switch_peer_crl_next_update_timestamp_seconds - time()) / 3600",
                "{{cluster}} holds {{peer}}'s",
            )
        ],
        12,
    ),
    (
        "Codecs per stage (forward / backward)",
        "none",
        [("nebula_trainer_stage_codec", "{{job_id}} {{stage}}: {{forward}} / {{backward}} ({{choice}})")],
        12,
    ),
    (
        "Stages ended per hour (by state)",
        "none",
        [
            (
                "sum by (cluster, state) (increase(nebula_trainer_stages_finished_total[1h]))",
                "{{cluster}} {{state}}",
            )
        ],
        12,
    ),
    (
        "Audit logs: free disk, failed writes",
        "percentunit",
        [
            ("min by (cluster, service) (nebula_audit_disk_free_ratio)", "{{cluster}} {{service}} free"),
            (
                "sum by (cluster, service) (increase(nebula_audit_write_failures_total[1h]))",
                "{{cluster}} {{service}} failed writes / h",
            ),
        ],
        12,
    ),
]


def build() -> dict:
    panels = []
    x = y = 0
    for index, (title, unit, queries, width) in enumerate(PANELS, start=1):
        if x + width > 24:
            x, y = 0, y + 8
        panels.append(
            {
                "id": index,
                "type": "timeseries",
                "title": title,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"x": x, "y": y, "w": width, "h": 8},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [
                    {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
                    for i, (expr, legend) in enumerate(queries)
                ],
            }
        )
        x += width
    return {
        "title": "Nebula: WAN link, training, access",
        "uid": "nebula-overview",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-30m", "to": "now"},
        "refresh": "10s",
        "tags": ["nebula"],
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}
            ]
        },
        "panels": panels,
    }


PROMETHEUS_HEADER = """# GENERATED by tools/build_dashboard.py (launcher/monitoring.py): do not edit by hand.
# Prometheus of cluster {cluster} (compose profile `monitoring`): scrapes only its own cluster's five
# services over the cluster network, each over mutual TLS with the cluster's scraper identity
# (role monitoring, exported by pki-init into /etc/prometheus/nebula-tls) pinning the service it
# expects; labels each `cluster`/`service` (what the dashboard groups by) and evaluates alerts.yml.
"""


def prometheus_config_text(cluster: str) -> str:
    """docker/monitoring/prometheus-cluster-<cluster>.yml for the compose deployment."""
    import yaml

    from nebula_common.launcher.monitoring import ScrapeTarget, prometheus_config

    targets = [
        ScrapeTarget(f"{service}-{cluster}:9100", cluster, service, "/etc/prometheus/nebula-tls")
        for service in ("switch", "trainer", "auth", "codec", "data")
    ]
    config = prometheus_config(targets, interval_s=5, rule_files=["/etc/prometheus/alerts.yml"])
    return PROMETHEUS_HEADER.format(cluster=cluster) + yaml.safe_dump(config, sort_keys=False)


K8S_GENERATED = ROOT / "k8s" / "components" / "monitoring" / "generated"
K8S_HEADER = """# GENERATED by tools/build_dashboard.py: do not edit by hand. A cluster's Prometheus in k8s
# (k8s/components/monitoring): finds this namespace's Nebula pods (role pod) and scrapes each service
# over mutual TLS with the scraper identity, pinning <service>.<cluster>.nebula.internal. The init
# container puts the cluster id (ConfigMap nebula-cluster) in place of @CLUSTER@.
"""


def kubernetes_prometheus_template() -> str:
    """The Kubernetes Prometheus config, one scrape config per service (each pins its own name)."""
    import yaml

    scrape_configs = []
    for service in ("switch", "trainer", "auth", "codec", "data"):
        scrape_configs.append(
            {
                "job_name": f"nebula-{service}",
                "scheme": "https",
                "tls_config": {
                    "ca_file": "/etc/prometheus/nebula-tls/ca.crt",
                    "cert_file": "/etc/prometheus/nebula-tls/service.crt",
                    "key_file": "/etc/prometheus/nebula-tls/service.key",
                    "server_name": f"{service}.@CLUSTER@.nebula.internal",
                    "min_version": "TLS13",
                },
                "kubernetes_sd_configs": [
                    {
                        "role": "pod",
                        "namespaces": {"own_namespace": True},
                        "selectors": [{"role": "pod", "label": f"app.kubernetes.io/name=nebula-{service}"}],
                    }
                ],
                "relabel_configs": [
                    {
                        "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                        "regex": "metrics",
                        "action": "keep",
                    },
                    {"target_label": "job", "replacement": "nebula"},
                    {"target_label": "cluster", "replacement": "@CLUSTER@"},
                    {"target_label": "service", "replacement": service},
                    {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                ],
            }
        )
    config = {
        "global": {"scrape_interval": "15s", "evaluation_interval": "15s"},
        "rule_files": ["/etc/prometheus/rules/alerts.yml"],
        "scrape_configs": scrape_configs,
    }
    return K8S_HEADER + yaml.safe_dump(config, sort_keys=False)


def main() -> int:
    from _generated import write_or_check  # tools/ is on sys.path: this file runs as a script

    command = "python tools/build_dashboard.py"
    dashboard = json.dumps(build(), indent=2) + "\n"
    status = write_or_check(OUT, dashboard, command)
    for cluster in ("a", "b"):
        path = OUT.parent / f"prometheus-cluster-{cluster}.yml"
        status |= write_or_check(path, prometheus_config_text(cluster), command)
    # Kustomize reads files only below the component: copies, kept fresh here.
    provisioning = OUT.parent / "grafana" / "provisioning"
    K8S_GENERATED.mkdir(parents=True, exist_ok=True)
    copies = {
        "prometheus.yml.template": kubernetes_prometheus_template(),
        "alerts.yml": (OUT.parent / "alerts.yml").read_text(),
        "grafana-datasource.yml": (provisioning / "datasources" / "nebula.yml").read_text(),
        "grafana-dashboards.yml": (provisioning / "dashboards" / "nebula.yml").read_text(),
        "nebula-dashboard.json": dashboard,
    }
    for name, text in copies.items():
        status |= write_or_check(K8S_GENERATED / name, text, command)
    return status


if __name__ == "__main__":
    sys.exit(main())
