"""The three-cluster Kubernetes overlays (k8s/overlays/three-clusters/cluster-{a,b,c}) render and wire
every pair of switches: each switch lists both others in NEBULA_SWITCH_PEERS (the multi-peer component
replaces the single-peer settings), of each pair the id that sorts first dials, and each peer's CRL is a
file of the switch's TLS Secret."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.test_deploy_manifests import K8S, WAN_PORT, _build_settings, _check_env_names

OVERLAYS = {c: K8S / "overlays" / "three-clusters" / f"cluster-{c}" for c in "abc"}


def _render(cluster: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: the overlays cannot be rendered")
    result = subprocess.run(
        [kubectl, "kustomize", str(OVERLAYS[cluster])], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def _switch_env(docs: list[dict[str, Any]]) -> tuple[dict[str, str], set[str]]:
    """The switch container's environment (ConfigMap keys resolved) and the names it declares."""
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"]
    (switch,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "nebula-switch"]
    (container,) = [c for c in switch["spec"]["template"]["spec"]["containers"] if c["name"] == "switch"]
    env = {}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = str(item["value"])
        else:
            ref = item["valueFrom"]["configMapKeyRef"]
            config_name = config["metadata"]["name"]
            assert config_name.startswith(ref["name"]), f"{item['name']}: ConfigMap {ref['name']}"
            env[item["name"]] = config["data"][ref["key"]]
    return env, {item["name"] for item in container["env"]}


@pytest.mark.parametrize("cluster", sorted(OVERLAYS))
def test_three_cluster_overlay_renders_a_switch_linked_to_both_others(
    cluster: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = _render(cluster)
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"nebula"}
    workloads = {d["metadata"]["name"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    assert workloads == {f"nebula-{s}" for s in ("auth", "codec", "data", "switch", "trainer")}
    env, declared = _switch_env(docs)
    _check_env_names(f"three-clusters/cluster-{cluster}", ["nebula-switch"], declared)
    settings = _build_settings(monkeypatch, ["nebula-switch"], env)
    assert settings.cluster_id == cluster and settings.peer_cluster_id is None
    peers = settings.peer_list()
    others = [c for c in "abc" if c != cluster]
    assert [p.cluster_id for p in peers] == others
    for peer in peers:
        assert peer.dials(cluster) == (cluster < peer.cluster_id), peer
        if cluster < peer.cluster_id:
            assert peer.address is not None and peer.address.endswith(f":{WAN_PORT}")
        else:
            assert peer.address is None  # it dials us
        assert peer.crl == Path(f"/etc/nebula/tls/peer-crl-{peer.cluster_id}.pem")
    assert settings.wan_listen == f"0.0.0.0:{WAN_PORT}"


@pytest.mark.parametrize("cluster", sorted(OVERLAYS))
def test_every_peer_crl_is_a_file_of_the_switch_tls_secret(cluster: str) -> None:
    """The base projects only the single-peer keys of nebula-switch-tls (``items``); a switch with
    several peers reads one ``peer-crl-<peer>.pem`` per peer, so each must be projected too (else the
    pod would start without its peers' revocation lists)."""
    docs = _render(cluster)
    env, _ = _switch_env(docs)
    (switch,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "nebula-switch"]
    pod = switch["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "switch"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    crls = [Path(p["crl"]) for p in yaml.safe_load(env["NEBULA_SWITCH_PEERS"])]
    assert len(crls) == 2
    for crl in crls:
        volume = volumes[mounts[str(crl.parent)]]
        assert volume["secret"]["secretName"] == "nebula-switch-tls", volume
        items = volume["secret"].get("items")
        assert items is None or crl.name in {i["path"] for i in items}, f"{crl} is not projected: {items}"
    assert "NEBULA_SWITCH_PEER_CRL" not in env
