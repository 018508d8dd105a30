"""Which carrier each container deployment gives its stages' edges, read from the manifests.

The rule (docs/deployments.md, "Stages' edges"): where a cluster's switch and trainer share a host,
every stage carries its edges as records on the switch's edge socket (services/switch/edge_socket.py),
on connections its trainer makes there and passes to it; where they do not (Kubernetes: separate pods),
as sealed records on the switch's TCP edge port after mutual TLS 1.3. So in every compose file the
switch names its edge socket (NEBULA_SWITCH_EDGE_SOCKET),
its cluster's trainer names the same path (NEBULA_TRAINER_SWITCH_EDGE_SOCKET), and the socket's
directory is a named volume of that cluster that only the two of them mount: the switch read-write (it
makes the socket), the trainer read-only (connecting needs no write access to the directory). The
image makes that directory 0711 and owned by the runtime user, which a fresh named volume copies. In
Kubernetes the switch serves the port (7402), its Service exposes it, the trainer names it, and a
NetworkPolicy lets only the trainer's pods reach it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.test_compose_organisation import ORGS
from tests.unit.test_compose_organisation import _compose as _organisation
from tests.unit.test_deploy_manifests import (
    DOCKERFILE,
    K8S,
    OVERLAYS,
    ROOT,
    RUNTIME_UID,
    _build_settings,
    _compose_env,
    _containers,
    _k8s_env,
    _overlay_config,
    _volume_mounts,
)

EDGE_DIR = "/var/lib/nebula/edges"


def _services(path: Path) -> dict[str, dict[str, Any]]:
    return yaml.safe_load(path.read_text())["services"]


def _check_records_edges(
    monkeypatch: pytest.MonkeyPatch,
    services: dict[str, dict[str, Any]],
    switch: str,
    trainer: str,
    volume: str,
) -> str:
    """``switch`` serves its edge socket in ``volume``, which only it (read-write) and ``trainer``
    (read-only) mount, at the directory of the one path both settings name. Returns the path."""
    served = _build_settings(monkeypatch, ["nebula-switch"], _compose_env(services[switch])).edge_socket
    named = _build_settings(
        monkeypatch, ["nebula-trainer"], _compose_env(services[trainer])
    ).switch_edge_socket
    assert served, f"{switch} serves no edge socket: its stages would carry their edges over gRPC"
    assert named == served, f"{trainer} names {named!r}, {switch} serves {served!r}"
    mounts = {
        name: (target, read_only)
        for name, svc in services.items()
        for source, target, read_only in _volume_mounts(svc)
        if source == volume
    }
    directory = str(Path(served).parent)
    assert mounts == {switch: (directory, False), trainer: (directory, True)}, (
        f"{volume} must be mounted by {switch} (read-write) and {trainer} (read-only) only: {mounts}"
    )
    return served


def test_the_image_makes_the_edge_socket_directory_0711_for_the_runtime_user() -> None:
    """A fresh named volume takes the owner and mode of the image's directory it is mounted on."""
    runtime = DOCKERFILE.read_text()[DOCKERFILE.read_text().rindex("FROM ") :]
    made = re.findall(rf"install -d -o {RUNTIME_UID} -g {RUNTIME_UID} -m 0711 ([^\\\n]+)", runtime)
    assert EDGE_DIR in " ".join(made).split(), made


def test_two_clusters_carry_edges_as_records(monkeypatch: pytest.MonkeyPatch) -> None:
    services = _services(ROOT / "docker-compose.yml")  # the monitoring profile's services included
    for c in ("a", "b"):
        path = _check_records_edges(monkeypatch, services, f"switch-{c}", f"trainer-{c}", f"switch-{c}-edges")
        assert path == f"{EDGE_DIR}/switch.sock"


def test_three_clusters_carry_edges_as_records(monkeypatch: pytest.MonkeyPatch) -> None:
    services = _services(ROOT / "docker" / "compose-3clusters.yml")
    for c in ("a", "b", "c"):
        _check_records_edges(monkeypatch, services, f"switch-{c}", f"trainer-{c}", f"switch-{c}-edges")


@pytest.mark.parametrize("org", sorted(ORGS))
def test_an_organisations_cluster_carries_edges_as_records(org: str, monkeypatch: pytest.MonkeyPatch) -> None:
    services = _organisation(org)["services"]
    _check_records_edges(monkeypatch, services, "switch", "trainer", "switch-edges")


K8S_EDGES = 7402


def test_kubernetes_carries_edges_as_sealed_records_on_the_switchs_edge_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In every overlay the switch serves its edge socket on a TCP port and the trainer names that port
    of the switch's Service: records after mutual TLS, not gRPC through the stage proxy."""
    for cluster in OVERLAYS:
        config = _overlay_config(cluster)
        served = named = ""
        for name, _, container in _containers():
            command = container["command"]
            if command[0] == "nebula-switch":
                served = _build_settings(monkeypatch, command, _k8s_env(container, config)).edge_socket
                ports = {p["name"]: p["containerPort"] for p in container["ports"]}
                assert ports.get("edges") == K8S_EDGES, f"k8s {name}: no container port 'edges' {K8S_EDGES}"
            elif command[0] == "nebula-trainer":
                named = _build_settings(monkeypatch, command, _k8s_env(container, config)).switch_edge_socket
        assert served == f"0.0.0.0:{K8S_EDGES}", f"cluster {cluster}: the switch serves {served!r}"
        assert named == f"nebula-switch:{K8S_EDGES}", f"cluster {cluster}: the trainer names {named!r}"


def _k8s_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_the_switchs_service_exposes_the_edge_port_to_its_trainer_only() -> None:
    service = next(
        doc
        for doc in _k8s_documents(K8S / "base" / "switch.yaml")
        if doc["kind"] == "Service" and doc["metadata"]["name"] == "nebula-switch"
    )
    assert {"name": "edges", "port": K8S_EDGES, "targetPort": "edges"} in service["spec"]["ports"]
    policies = [
        d for d in _k8s_documents(K8S / "base" / "networkpolicy.yaml") if d["kind"] == "NetworkPolicy"
    ]
    opening = []
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            if any(port.get("port") == K8S_EDGES for port in rule.get("ports", [])):
                opening.append((policy["metadata"]["name"], rule.get("from")))
    assert opening == [
        (
            "nebula-allow-switch-edges",
            [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "nebula-trainer"}}}],
        )
    ], f"port {K8S_EDGES} must be open to the trainer's pods only: {opening}"
