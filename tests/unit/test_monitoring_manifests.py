"""The compose profile `monitoring` as written: a Prometheus and a Grafana per cluster, each on its own
cluster's network, hardened like the services, holding only its own secrets; what pki-init hands them.

The profile against live services is docker/smoke_monitoring.py (in `make smoke-containers`); the
scrape configs and rules against a real Prometheus are tests/integration/test_dashboards.py and
test_alerts.py.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from nebula_common.pki import init_pki
from nebula_common.pki.identity import Identity, identity_from_pem
from tests.support import k8s_schemas

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "docker" / "monitoring"
PROFILE = {"prometheus-a", "prometheus-b", "grafana-a", "grafana-b"}


def _services() -> dict[str, dict[str, Any]]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def _mounts(svc: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """target -> (source, read_only)."""
    found = {}
    for entry in svc.get("volumes") or []:
        parts = str(entry).split(":")
        found[parts[1]] = (parts[0], len(parts) > 2 and "ro" in parts[2].split(","))
    return found


def test_the_profile_holds_a_prometheus_and_a_grafana_per_cluster_and_nothing_else() -> None:
    profiled = {name for name, svc in _services().items() if svc.get("profiles")}
    assert profiled == PROFILE
    assert all(_services()[name]["profiles"] == ["monitoring"] for name in PROFILE)


@pytest.mark.parametrize("cluster", ["a", "b"])
def test_each_prometheus_sees_only_its_cluster_and_is_not_published(cluster: str) -> None:
    svc = _services()[f"prometheus-{cluster}"]
    assert svc["networks"] == [f"cluster_{cluster}"]
    assert not svc.get("ports"), "its API serves every job's and account's series: never on the host"
    assert svc["image"] == "localhost/nebula-prometheus:dev" and svc["pull_policy"] == "never"
    assert svc["build"]["dockerfile"] == "docker/Dockerfile.prometheus"
    mounts = _mounts(svc)
    assert mounts["/etc/prometheus/prometheus.yml"] == (
        f"./docker/monitoring/prometheus-cluster-{cluster}.yml",
        True,
    )
    assert mounts["/etc/prometheus/alerts.yml"] == ("./docker/monitoring/alerts.yml", True)
    assert mounts["/etc/prometheus/nebula-tls"] == (f"monitoring-{cluster}-tls", True)
    assert mounts["/prometheus"] == (f"prometheus-{cluster}-data", False)
    config = yaml.safe_load((MONITORING / f"prometheus-cluster-{cluster}.yml").read_text())
    assert "--config.file=/etc/prometheus/prometheus.yml" in svc["command"]
    assert all(
        job["tls_config"]["ca_file"].startswith("/etc/prometheus/nebula-tls/")
        for job in config["scrape_configs"]
    )


@pytest.mark.parametrize("cluster", ["a", "b"])
def test_each_grafana_is_on_loopback_behind_its_own_admin_and_reads_its_clusters_prometheus(
    cluster: str,
) -> None:
    svc = _services()[f"grafana-{cluster}"]
    assert svc["networks"] == [f"cluster_{cluster}"]
    assert svc["ports"] and all(str(port).startswith("127.0.0.1:") for port in svc["ports"])
    env = svc["environment"]
    assert env["NEBULA_PROMETHEUS_URL"] == f"http://prometheus-{cluster}:9090"
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false" and env["GF_USERS_ALLOW_SIGN_UP"] == "false"
    mounts = _mounts(svc)
    assert mounts["/etc/grafana/admin"] == (f"grafana-{cluster}-admin", True)
    assert env["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/etc/grafana/admin/admin-password"
    assert mounts["/etc/grafana/provisioning"] == ("./docker/monitoring/grafana/provisioning", True)
    dashboard_target = next(t for t, (src, _) in mounts.items() if src.endswith("nebula-dashboard.json"))
    provider = yaml.safe_load(
        (MONITORING / "grafana" / "provisioning" / "dashboards" / "nebula.yml").read_text()
    )
    assert Path(dashboard_target).parent == Path(provider["providers"][0]["options"]["path"])
    datasource = yaml.safe_load(
        (MONITORING / "grafana" / "provisioning" / "datasources" / "nebula.yml").read_text()
    )
    assert datasource["datasources"][0]["url"] == "${NEBULA_PROMETHEUS_URL}"


@pytest.mark.parametrize("name", sorted(PROFILE))
def test_the_profile_is_hardened_like_the_services(name: str) -> None:
    svc = _services()[name]
    assert str(svc["user"]).split(":")[0] == "10001"
    assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"]
    assert "no-new-privileges:true" in svc["security_opt"]
    assert svc["restart"] == "unless-stopped" and svc["deploy"]["resources"]["limits"]["memory"]
    for source, read_only in _mounts(svc).values():
        if source.endswith(("-tls", "-admin")):
            assert read_only and source.startswith(name.split("-")[0].replace("prometheus", "monitoring"))


def test_pki_init_hands_each_cluster_its_scraper_identity_and_grafana_password(tmp_path: Path) -> None:
    init = _services()["pki-init"]
    for cluster in "ab":
        assert f"/export/monitoring-{cluster}-tls" in _mounts(init)
        assert f"/export/grafana-{cluster}-admin" in _mounts(init)
    layout = init_pki(tmp_path / "pki", ["a", "b"])
    out = tmp_path / "export"
    internal = [f"{s}-{c}-internal-tls" for c in "ab" for s in ("auth", "codec", "data", "switch", "trainer")]
    for volume in (
        "switch-a",
        "switch-b",
        "auth-a",
        "auth-b",
        *internal,
        "monitoring-a-tls",
        "grafana-a-admin",
    ):
        (out / volume).mkdir(parents=True)
    spec = importlib.util.spec_from_file_location("pki_export", ROOT / "docker" / "pki_export.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--pki", str(layout.root), "--out", str(out), "--clusters", "a,b"]) == 0
    scraper = out / "monitoring-a-tls"
    assert sorted(p.name for p in scraper.iterdir()) == ["ca.crt", "service.crt", "service.key"]
    assert identity_from_pem((scraper / "service.crt").read_bytes()) == Identity("a", "monitoring")
    assert (scraper / "service.key").stat().st_mode & 0o777 == 0o400
    password = (out / "grafana-a-admin" / "admin-password").read_bytes()
    assert len(password) >= 24 and password != (out / "auth-a" / "admin-password").read_bytes()
    # Not mounted for b: nothing exported there; but the identity is kept in the PKI for the host.
    assert not (out / "monitoring-b-tls").exists()
    assert (layout.root / "b" / "services" / "monitoring" / "service.crt").is_file()


def test_compose_renders_the_profile() -> None:
    engine = shutil.which("podman-compose") or shutil.which("docker-compose")
    if engine is None:
        pytest.skip("no compose engine to render with (the YAML is checked above)")
    done = subprocess.run(
        [engine, "-f", str(ROOT / "docker-compose.yml"), "--profile", "monitoring", "config"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rendered = yaml.safe_load(done.stdout)
    assert set(rendered["services"]) >= PROFILE


@pytest.mark.parametrize("cluster", ["a", "b"])
def test_kubernetes_clusters_come_up_with_their_prometheus_and_grafana(cluster: str) -> None:
    """The overlays render the monitoring component: valid objects, hardened pods, Prometheus reachable by
    Grafana only, discovery limited to reading this namespace's pods, the scraper identity a Secret."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed; the component's YAML is checked by test_deploy_manifests")
    overlay = ROOT / "k8s" / "overlays" / f"cluster-{cluster}"
    done = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    invalid = [error for doc in docs for error in k8s_schemas.errors(doc)]
    assert not invalid, "\n".join(invalid)
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    prometheus = by[("Deployment", "nebula-prometheus")]["spec"]["template"]["spec"]
    grafana = by[("Deployment", "nebula-grafana")]["spec"]["template"]["spec"]
    for pod in (prometheus, grafana):
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"] + pod.get("initContainers", []):
            assert container["securityContext"]["readOnlyRootFilesystem"] is True
            assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
            assert container["resources"]["limits"]["memory"]
    assert by[("Role", "nebula-prometheus")]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    assert ("ClusterRole", "nebula-prometheus") not in by
    (init,) = prometheus["initContainers"]
    (env,) = init["env"]  # the cluster id, from the overlay's nebula-cluster ConfigMap (hashed name)
    assert env["name"] == "CLUSTER_ID" and env["valueFrom"]["configMapKeyRef"]["key"] == "cluster_id"
    cluster_map = next(d for d in docs if d["kind"] == "ConfigMap" and d["data"].get("cluster_id") == cluster)
    assert env["valueFrom"]["configMapKeyRef"]["name"] == cluster_map["metadata"]["name"]
    secrets = {
        v["secret"]["secretName"] for pod in (prometheus, grafana) for v in pod["volumes"] if "secret" in v
    }
    assert secrets == {"nebula-monitoring-tls", "nebula-grafana-admin"}
    for kind, name in (("Service", "nebula-prometheus"), ("Service", "nebula-grafana")):
        assert by[(kind, name)]["spec"]["type"] == "ClusterIP"
    policy = by[("NetworkPolicy", "nebula-allow-grafana-to-prometheus")]["spec"]
    assert policy["ingress"] == [
        {
            "from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "nebula-grafana"}}}],
            "ports": [{"protocol": "TCP", "port": 9090}],
        }
    ]
    config = next(
        d
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("nebula-prometheus-config")
    )
    template = yaml.safe_load(config["data"]["prometheus.yml.template"])
    jobs = {job["job_name"]: job for job in template["scrape_configs"]}
    assert sorted(jobs) == [f"nebula-{s}" for s in ("auth", "codec", "data", "switch", "trainer")]
    for name, job in jobs.items():
        service = name.removeprefix("nebula-")
        assert (
            job["scheme"] == "https"
            and job["tls_config"]["server_name"] == f"{service}.@CLUSTER@.nebula.internal"
        )
        assert job["kubernetes_sd_configs"][0]["namespaces"] == {"own_namespace": True}
    assert yaml.safe_load(config["data"]["alerts.yml"]) == yaml.safe_load(
        (MONITORING / "alerts.yml").read_text()
    )
