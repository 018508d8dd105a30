"""The shipped alert rules fire against live services: a cut WAN link and an expiring certificate.

A real Prometheus (Debian's binary) scrapes both clusters of a `nebula local up` deployment over
mutual TLS with the clusters' monitoring identities and evaluates ``docker/monitoring/alerts.yml``.
The rules are the shipped ones with one change: every hold time (``for``) is one second, so the test
does not wait minutes (``promtool test rules`` in ``tests/unit/test_alert_rules.py`` checks the real
hold times). Nothing fires on the healthy deployment; cutting the WAN fires ``NebulaLinkDown`` on both
switches and restoring it ends it; a switch certificate that has 12 hours left fires
``NebulaSwitchCertificateExpiring`` for that cluster only.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import yaml

from nebula_common.launcher import LocalDeployment
from nebula_common.launcher.monitoring import described_targets
from nebula_common.pki.lifecycle import renew_switch_certificate
from tests.integration.test_link_loss import restore_wan
from tests.support.prometheus import REQUIRE_ENV, Prometheus, prometheus_binary, running_prometheus

AUDIT_DISK_LOW_BYTES = 1 << 30  # NebulaAuditDiskLow's threshold in alerts.yml
RULES = Path(__file__).resolve().parents[2] / "docker" / "monitoring" / "alerts.yml"
# A cut and a certificate change on a deployment of its own (about 40 s): `make test-faults` and
# `make check-dashboards`, both in CI.
pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    if prometheus_binary() is None:
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{REQUIRE_ENV} is set but no prometheus binary is on PATH (apt-get install it)")
        pytest.skip("prometheus not installed (Debian: apt-get install prometheus; CI installs it)")
    with LocalDeployment(run_dir=tmp_path_factory.mktemp("nebula-alerts")) as running:
        yield running


@pytest.fixture(scope="module")
def prometheus(deployment: LocalDeployment, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    workdir = tmp_path_factory.mktemp("prometheus")
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "1s"
    (workdir / "alerts.yml").write_text(yaml.safe_dump(rules))
    description = deployment.describe()
    targets = [each for cluster in deployment.clusters for each in described_targets(description, cluster)]
    with running_prometheus(
        workdir, targets, interval_s=1.0, rule_files=[str(workdir / "alerts.yml")]
    ) as server:
        server.wait_targets_up(len(targets), timeout_s=60)
        yield server


def _firing(prometheus: Prometheus) -> list[tuple[str, str]]:
    return sorted(
        (alert["labels"]["alertname"], alert["labels"].get("cluster", ""))
        for alert in prometheus.alerts()
        if alert["state"] == "firing"
    )


def test_nothing_fires_on_a_healthy_deployment(deployment: LocalDeployment, prometheus: Prometheus) -> None:
    started = time.time()
    prometheus.wait_scraped_after(started + 2, timeout_s=30)  # a few evaluations over fresh series
    rules = prometheus.rules()
    assert len(rules) >= 9 and all(rule["health"] == "ok" for rule in rules), rules
    # The one alert about the host rather than Nebula: it must fire when this machine's disk is low.
    disk_rule = next(rule for rule in rules if rule["name"] == "NebulaAuditDiskLow")
    metric, threshold = disk_rule["query"].split(" < ")
    assert (metric, float(threshold)) == ("nebula_audit_disk_free_bytes", AUDIT_DISK_LOW_BYTES), disk_rule
    low_disk = shutil.disk_usage(deployment.run_dir).free < AUDIT_DISK_LOW_BYTES
    expected = sorted({("NebulaAuditDiskLow", cluster) for cluster in ("a", "b")}) if low_disk else []
    assert sorted(set(_firing(prometheus))) == expected


def test_a_cut_link_fires_link_down_on_both_switches_and_the_restore_ends_it(
    deployment: LocalDeployment, prometheus: Prometheus
) -> None:
    wan = deployment.wan
    wan.cut()
    try:
        for cluster, peer in (("a", "b"), ("b", "a")):
            alert = prometheus.wait_alert("NebulaLinkDown", {"cluster": cluster, "peer": peer}, timeout_s=60)
            assert alert["annotations"]["summary"] == f"WAN link from cluster {cluster} to {peer} is down"
    finally:
        restore_wan(wan)
    deadline = time.monotonic() + 90
    while any(name == "NebulaLinkDown" for name, _ in _firing(prometheus)):
        assert time.monotonic() < deadline, (
            f"NebulaLinkDown still firing 90 s after the restore: {_firing(prometheus)}"
        )
        time.sleep(0.5)


def test_a_switch_certificate_with_hours_left_fires_for_its_cluster_only(
    deployment: LocalDeployment, prometheus: Prometheus
) -> None:
    renew_switch_certificate(deployment.pki_dir, "b", validity=timedelta(hours=12))
    alert = prometheus.wait_alert("NebulaSwitchCertificateExpiring", {"cluster": "b"}, timeout_s=60)
    assert alert["labels"]["severity"] == "warning"
    assert (
        "expires in 11h" in alert["annotations"]["summary"]
        or "expires in 12h" in alert["annotations"]["summary"]
    )
    assert ("NebulaSwitchCertificateExpiring", "a") not in _firing(prometheus)
