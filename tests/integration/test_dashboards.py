"""The Grafana dashboard is proven against reality: its JSON is fresh, every metric it names is exported,
and every panel query returns data in a real Prometheus scraping a live deployment during a job."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from nebula_common.clients.data import DataClient
from nebula_common.launcher import LocalDeployment
from nebula_common.launcher.monitoring import described_targets
from nebula_common.metrics import read_metrics
from nebula_common.proto.nebula.v1 import relay_pb2, relay_pb2_grpc
from nebula_common.sdk.client import ClusterSession, submit_job
from nebula_common.sdk.summary import summarize
from tests.support.internal import user_channel
from tests.support.jobs import numbers_job
from tests.support.prometheus import REQUIRE_ENV, prometheus_binary, running_prometheus

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docker" / "monitoring" / "nebula-dashboard.json"
MONITORING = ROOT / "docker" / "monitoring"
SCRAPE_S = 1.0
pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def exported_sample_names(deployment: LocalDeployment) -> set[str]:
    names: set[str] = set()
    for cluster in deployment.clusters:
        for url in deployment.endpoints(cluster).metrics.values():
            for family in text_string_to_metric_families(read_metrics(url)):
                names.update(sample.name for sample in family.samples)
    return names


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]


def provoke_labelled_series(deployment: LocalDeployment, sessions: dict[str, ClusterSession]) -> None:
    """Labelled counters appear once they count something: one refused call, one data-service call."""
    with user_channel(deployment.endpoints("a").switch, "switch") as channel, pytest.raises(grpc.RpcError):
        relay_pb2_grpc.RelayStub(channel).GetLinkStatus(relay_pb2.GetLinkStatusRequest(), timeout=5)
    for cluster, session in sessions.items():
        with DataClient(deployment.data_address(cluster), session.token) as data:
            data.list()


def test_dashboard_json_is_generated_from_the_panel_list() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "build_dashboard.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_every_dashboard_metric_is_exported(
    deployment: LocalDeployment, sessions: dict[str, ClusterSession]
) -> None:
    job = numbers_job(steps=2, data__batch_size=16)
    assert summarize(job, submit_job(job, sessions)).succeeded
    provoke_labelled_series(deployment, sessions)
    exported = exported_sample_names(deployment)
    queried = {name for _, expr in dashboard_queries() for name in re.findall(r"\bnebula_[a-z0-9_]+", expr)}
    assert len(queried) >= 10
    missing = sorted(queried - exported)
    assert not missing, f"dashboard queries metrics no service exports: {missing}"
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    alerted = {
        name
        for group in rules["groups"]
        for rule in group["rules"]
        for name in re.findall(r"\bnebula_[a-z0-9_]+", rule["expr"])
    }
    assert len(alerted) >= 8  # the regex found the rules: nine alerts over eight metrics
    missing = sorted(alerted - exported)
    assert not missing, f"alert rules name metrics no service exports: {missing}"


def test_prometheus_configs_scrape_every_service() -> None:
    """The compose Prometheus configs scrape each cluster's five services over mutual TLS, labelled like the
    dashboard wants, and load the alert rules."""
    for cluster in ("a", "b"):
        config = yaml.safe_load((MONITORING / f"prometheus-cluster-{cluster}.yml").read_text())
        groups = [group for job in config["scrape_configs"] for group in job["static_configs"]]
        services = {group["labels"]["service"]: group["targets"] for group in groups}
        assert sorted(services) == ["auth", "codec", "data", "switch", "trainer"], services
        for service, targets in services.items():
            assert targets == [f"{service}-{cluster}:9100"]
        assert {group["labels"]["cluster"] for group in groups} == {cluster}
        for job in config["scrape_configs"]:  # every scrape is mutual TLS, pinning its service
            service = job["static_configs"][0]["labels"]["service"]
            assert job["scheme"] == "https", job
            assert job["tls_config"]["server_name"] == f"{service}.{cluster}.nebula.internal"
            assert job["tls_config"]["cert_file"] == "/etc/prometheus/nebula-tls/service.crt"
        assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]


@pytest.mark.long  # a Prometheus beside a job (`make test-faults`)
def test_every_dashboard_query_returns_data_in_prometheus_during_a_job(
    deployment: LocalDeployment, sessions: dict[str, ClusterSession], tmp_path: Path
) -> None:
    """Real Prometheus, real services, a real job: each panel query must return finite values.

    The queries are evaluated over the job's time range (query_range), so series that end with the job
    (per-job gauges) count, and rate() windows see the job's traffic.
    """
    if prometheus_binary() is None:
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{REQUIRE_ENV} is set but no prometheus binary is on PATH (apt-get install it)")
        pytest.skip("prometheus not installed (Debian: apt-get install prometheus; CI installs it)")
    description = deployment.describe()
    targets = [
        target for cluster in deployment.clusters for target in described_targets(description, cluster)
    ]
    assert {t.service for t in targets} >= {"auth", "codec", "data", "switch", "trainer"}
    assert all(t.tls_dir for t in targets)  # every /metrics is read with the monitoring identity
    provoke_labelled_series(deployment, sessions)
    with running_prometheus(tmp_path / "prometheus", targets, interval_s=SCRAPE_S) as prometheus:
        prometheus.wait_targets_up(len(targets), timeout_s=60)
        start = time.time()
        job = numbers_job(steps=30, data__batch_size=16, checkpoint__interval=0)
        assert summarize(job, submit_job(job, sessions)).succeeded
        end = time.time()
        prometheus.wait_scraped_after(end + SCRAPE_S, timeout_s=30)
        # The check can fail: a query on a label value no series has returns nothing.
        assert prometheus.finite_points('nebula_switch_link_up{cluster="nowhere"}', start, end, SCRAPE_S) == 0
        empty = [
            f"{title}: {expr}"
            for title, expr in dashboard_queries()
            if prometheus.finite_points(expr, start, time.time(), SCRAPE_S) == 0
        ]
    assert len(dashboard_queries()) >= 12
    assert not empty, "dashboard queries that returned no data during a job:\n" + "\n".join(empty)
