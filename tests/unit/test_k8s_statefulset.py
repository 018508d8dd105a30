"""k8s/: the trainer as a StatefulSet, rank workers across pods, the GPU component, strict schemas.

Every overlay is rendered with ``kubectl kustomize`` (skipped without kubectl) and every object it
renders is validated strictly (unknown fields refused) against the OpenAPI schemas of two Kubernetes
versions, offline (``tests/support/k8s_schemas.py``, on ``kubernetes-validate``'s schemas). The rank
wiring is checked against the code that reads it: the worker's and the trainer's own settings parsing,
and the NetworkPolicies are evaluated for who may reach the trainer's rank store and the ranks'
rendezvous.
"""

from __future__ import annotations

import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.trainer.config import TrainerSettings
from services.trainer.worker import settings as worker_settings
from tests.support import k8s_schemas

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
THREE_CLUSTERS = tuple(f"three-clusters/cluster-{c}" for c in "abc")
OVERLAYS = ("cluster-a", "cluster-b", "org-a", "org-b", "cluster-a-ranks", *THREE_CLUSTERS)
# The oldest Kubernetes minor still widely supported by managed offerings, and the newest the schemas know.
K8S_VERSIONS = ("1.30.0", "1.37.0")
DATA_DIR = "/var/lib/nebula/trainer"


@cache
def _render(overlay: str) -> tuple[dict[str, Any], ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: the overlays cannot be rendered")
    result = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"{overlay}: {result.stderr}"
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


def _one(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container["env"]}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_validates_strictly(overlay: str, version: str) -> None:
    checked = 0
    for doc in _render(overlay):
        if doc["apiVersion"].startswith("cert-manager.io/"):
            continue  # a CRD: test_k8s_cert_manager.py checks it against cert-manager's fields
        found = k8s_schemas.errors(doc, version)
        assert not found, f"{overlay} on Kubernetes {version}: " + "; ".join(found)
        checked += 1
    assert checked >= 15


def test_strict_validation_refuses_an_unknown_field() -> None:
    """The check above can fail: a misspelt field is refused on both versions."""
    trainer = _one(_render("cluster-a"), "StatefulSet", "nebula-trainer")
    broken = yaml.safe_load(yaml.safe_dump(trainer))
    broken["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    for version in K8S_VERSIONS:
        assert not k8s_schemas.errors(trainer, version)
        found = k8s_schemas.errors(broken, version)
        assert any("'resource'" in error for error in found), (version, found)


@pytest.mark.parametrize("overlay", ["cluster-a", "cluster-b", *THREE_CLUSTERS])
def test_the_trainer_is_a_statefulset_with_a_headless_service_and_a_claim_per_pod(overlay: str) -> None:
    docs = _render(overlay)
    assert not [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "nebula-trainer"]
    trainer = _one(docs, "StatefulSet", "nebula-trainer")
    spec = trainer["spec"]
    assert spec["replicas"] == 1, "the SDK assigns and watches a job on one trainer"
    headless = _one(docs, "Service", spec["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    container = _container(trainer)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert {p["targetPort"] for p in headless["spec"]["ports"]} <= set(ports)
    # One claim per pod for the trainer's state, one for its audit signer's key (the signer sidecar's).
    template, keys = spec["volumeClaimTemplates"]
    for claim in (template, keys):
        assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
        assert claim["spec"]["resources"]["requests"]["storage"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[_env(container)["NEBULA_TRAINER_DATA_DIR"]] == template["metadata"]["name"]
    assert keys["metadata"]["name"] not in mounts.values(), "the trainer mounts its audit seal key"
    assert spec["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Retain"}
    resources = container["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"]) and "nvidia.com/gpu" not in resources["limits"]
    # The SDK's and the services' address stays the ClusterIP Service.
    service = _one(docs, "Service", "nebula-trainer")
    assert service["spec"]["type"] == "ClusterIP"
    # The other stateful services keep their data, and their signers the seal keys, on a ReadWriteOnce
    # claim each, in every cluster.
    claims = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    claims.pop("nebula-prometheus-data", None)  # the monitoring component's (test_monitoring_manifests)
    services = ("auth", "data", "switch")
    assert sorted(claims) == sorted(f"nebula-{s}-{kind}" for s in services for kind in ("data", "signer"))
    assert all(claim["accessModes"] == ["ReadWriteOnce"] for claim in claims.values())


def _ranks() -> tuple[tuple[dict[str, Any], ...], dict[str, Any], dict[str, Any]]:
    docs = _render("cluster-a-ranks")
    return docs, _one(docs, "StatefulSet", "nebula-trainer"), _one(docs, "StatefulSet", "nebula-trainer-rank")


def test_rank_workers_rendezvous_through_headless_services_and_reach_the_trainer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docs, trainer, ranks = _ranks()
    trainer_env, rank_env = _env(_container(trainer)), _env(_container(ranks))
    world = ranks["spec"]["replicas"]
    assert world >= 2 and ranks["spec"]["podManagementPolicy"] == "Parallel"
    assert int(rank_env["WORLD_SIZE"]) == world == int(trainer_env["NEBULA_TRAINER_RANKS"])
    assert trainer_env["NEBULA_TRAINER_RANKS_ACCOUNTS"] == "*"  # every account's driver is boxed too
    assert rank_env["RANK"] == {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
    # MASTER_ADDR: rank 0's stable name through the ranks' headless Service; the port is a rank port.
    rank_service = _one(docs, "Service", ranks["spec"]["serviceName"])
    assert rank_service["spec"]["clusterIP"] == "None" and rank_service["spec"]["publishNotReadyAddresses"]
    assert rank_env["MASTER_ADDR"] == f"nebula-trainer-rank-0.{ranks['spec']['serviceName']}"
    rank_ports = {p["name"]: p["containerPort"] for p in _container(ranks)["ports"]}
    assert int(rank_env["MASTER_PORT"]) in rank_ports.values()
    assert {p["targetPort"] for p in rank_service["spec"]["ports"]} <= set(rank_ports)
    # NEBULA_WORKER_TRAINER: trainer pod 0 through the trainer's headless Service, on its rank store.
    host, port = rank_env["NEBULA_WORKER_TRAINER"].rsplit(":", 1)
    assert host == f"nebula-trainer-0.{trainer['spec']['serviceName']}"
    listen_port = int(trainer_env["NEBULA_TRAINER_RANKS_LISTEN"].rsplit(":", 1)[1])
    assert int(port) == listen_port
    headless = _one(docs, "Service", trainer["spec"]["serviceName"])
    assert listen_port in {p["port"] for p in headless["spec"]["ports"]}
    # The code reads these exactly: the worker's settings for every rank, the trainer's with the patch.
    for rank in range(world):
        for name, value in rank_env.items():
            monkeypatch.setenv(name, str(rank) if name == "RANK" else value)
        parsed = worker_settings()
        assert (parsed["rank"], parsed["world"], parsed["trainer_port"]) == (rank, world, listen_port)
        assert str(parsed["data_dir"]) == DATA_DIR
    for name, value in trainer_env.items():
        if isinstance(value, str):
            monkeypatch.setenv(name, value)
    monkeypatch.setenv("NEBULA_TRAINER_CLUSTER_ID", "a")
    monkeypatch.setenv("NEBULA_TRAINER_LOG_LEVEL", "INFO")
    trainer_settings = TrainerSettings()
    assert trainer_settings.ranks == world and str(trainer_settings.data_dir) == DATA_DIR


def test_each_rank_has_its_claim_and_all_share_the_checkpoints() -> None:
    docs, trainer, ranks = _ranks()
    (template,) = ranks["spec"]["volumeClaimTemplates"]
    assert template["spec"]["accessModes"] == ["ReadWriteOnce"]
    shared = _one(docs, "PersistentVolumeClaim", "nebula-trainer-checkpoints")
    assert shared["spec"]["accessModes"] == ["ReadWriteMany"]
    for workload in (trainer, ranks):
        container = _container(workload)
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        own = workload["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
        assert mounts[DATA_DIR] == own, workload["metadata"]["name"]
        # CheckpointStore writes under <data dir>/accounts: every rank's shards and the trainer's list.
        checkpoints = volumes[mounts[f"{DATA_DIR}/accounts"]]
        assert checkpoints["persistentVolumeClaim"]["claimName"] == "nebula-trainer-checkpoints"


def test_rank_pods_are_hardened_and_bounded() -> None:
    _, _, ranks = _ranks()
    pod = ranks["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
    assert pod["enableServiceLinks"] is False
    container = _container(ranks)
    ctx = container["securityContext"]
    assert ctx["readOnlyRootFilesystem"] and not ctx["allowPrivilegeEscalation"]
    assert ctx["capabilities"]["drop"] == ["ALL"]
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert {"cpu", "memory"} <= set(container["resources"]["limits"])
    assert container["command"] == ["python", "-m", "services.trainer.worker"]
    # The rank store admits only the worker identity: mounted read-only where the worker reads it.
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    tls = mounts[env["NEBULA_WORKER_INTERNAL_TLS_DIR"]]
    assert tls["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == tls["name"])
    (source,) = volume["projected"]["sources"]
    assert source["secret"]["name"] == "nebula-worker-internal-tls"
    assert {i["path"] for i in source["secret"]["items"]} == {"ca.crt", "service.crt", "service.key"}


def _admits(
    policies: list[dict[str, Any]], source: dict[str, str], target: dict[str, str], port: int
) -> bool:
    """Whether a pod labelled ``source`` (same namespace) may open ``port`` on a pod labelled ``target``."""

    def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
        return selector.get("matchLabels", {}).items() <= labels.items()

    selecting = [p["spec"] for p in policies if selects(p["spec"]["podSelector"], target)]
    for spec in selecting:
        for rule in spec.get("ingress", []):
            sources = rule.get("from")
            if sources and not any("podSelector" in s and selects(s["podSelector"], source) for s in sources):
                continue
            for allowed in rule.get("ports", []):
                if allowed["port"] <= port <= allowed.get("endPort", allowed["port"]):
                    return True
    return False


def test_only_ranks_reach_the_rank_store_and_each_other() -> None:
    docs, trainer, ranks = _ranks()
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            for source in rule.get("from", []):
                assert set(source) == {"podSelector"}, (
                    f"{policy['metadata']['name']}: from outside the namespace"
                )
    rank = ranks["spec"]["template"]["metadata"]["labels"]
    trainer_pod = trainer["spec"]["template"]["metadata"]["labels"]
    switch = _one(docs, "Deployment", "nebula-switch")["spec"]["template"]["metadata"]["labels"]
    store = int(_env(_container(trainer))["NEBULA_TRAINER_RANKS_LISTEN"].rsplit(":", 1)[1])
    rendezvous = int(_env(_container(ranks))["MASTER_PORT"])
    assert _admits(policies, rank, trainer_pod, store)
    assert _admits(policies, rank, rank, rendezvous) and _admits(policies, rank, rank, 41234)  # gloo pairs
    assert not _admits(policies, switch, trainer_pod, store), "only ranks may reach the rank store"
    assert not _admits(policies, switch, rank, rendezvous) and not _admits(policies, trainer_pod, rank, 41234)
    assert _admits(policies, switch, trainer_pod, 7501), "the services' own port stays reachable"
    # The WAN port is the switch's alone: no rank or trainer port is open to every source.
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            if not rule.get("from"):
                assert (
                    policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "nebula-switch"
                )


def test_the_gpu_component_adds_one_gpu_to_the_trainer_and_every_rank() -> None:
    _, trainer, ranks = _ranks()
    for workload in (trainer, ranks):
        assert _container(workload)["resources"]["limits"]["nvidia.com/gpu"] == "1"
        tolerations = workload["spec"]["template"]["spec"]["tolerations"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    for doc in _render("cluster-a"):
        if doc["kind"] in ("StatefulSet", "Deployment"):
            assert "nvidia.com/gpu" not in _container(doc)["resources"].get("limits", {})
