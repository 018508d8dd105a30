"""docker/compose-3clusters.yml: three clusters, every pair of switches linked through an emulated WAN.

Checked as the settings classes read it: every NEBULA_* name is a field, each switch lists both other
clusters as peers (the id sorting first dials, through the emulator in front of the other's WAN
port), each peer's CRL is a file of the switch's own read-only TLS volume that pki-init writes
(docker/pki_export.py, run here on a real three-cluster PKI), only switches and emulators are on
the WAN and nothing is published beyond loopback.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml

from nebula_common.pki import init_pki
from tests.unit.test_deploy_manifests import (
    ROOT,
    WAN_PORT,
    _build_settings,
    _check_env_names,
    _command,
    _compose_env,
    _networks,
    _published,
    _volume_mounts,
)

COMPOSE_3 = ROOT / "docker" / "compose-3clusters.yml"
CLUSTERS = ("a", "b", "c")


def _services() -> dict[str, dict[str, Any]]:
    return yaml.safe_load(COMPOSE_3.read_text())["services"]


def test_every_pair_of_switches_is_linked_through_an_emulator(monkeypatch: pytest.MonkeyPatch) -> None:
    services = _services()
    targets = {}
    for name, svc in services.items():
        if name.startswith("wan-emulator-"):
            command = _command(svc)
            targets[name] = command[command.index("--target") + 1]
            assert command[command.index("--listen") + 1] == "0.0.0.0:7000"
            assert command[command.index("--control") + 1].startswith("127.0.0.1:")
    assert targets == {"wan-emulator-b": f"switch-b:{WAN_PORT}", "wan-emulator-c": f"switch-c:{WAN_PORT}"}
    for cluster in CLUSTERS:
        svc = services[f"switch-{cluster}"]
        env = _compose_env(svc)
        _check_env_names(f"compose-3clusters switch-{cluster}", ["nebula-switch"], set(env))
        settings = _build_settings(monkeypatch, ["nebula-switch"], env)
        assert settings.cluster_id == cluster and settings.peer_cluster_id is None
        peers = settings.peer_list()
        assert [p.cluster_id for p in peers] == [c for c in CLUSTERS if c != cluster]
        mounts = {target: source for source, target, _ in _volume_mounts(svc)}
        for peer in peers:
            if cluster < peer.cluster_id:
                assert peer.dials(cluster) and peer.address == f"wan-emulator-{peer.cluster_id}:7000"
                assert f"wan-emulator-{peer.cluster_id}" in svc["depends_on"]
            else:
                assert not peer.dials(cluster) and peer.address is None
            assert peer.crl == Path(f"/etc/nebula/tls/peer-crl-{peer.cluster_id}.pem")
            assert mounts[str(peer.crl.parent)] == f"switch-{cluster}-tls"
        trainer = _compose_env(services[f"trainer-{cluster}"])
        assert trainer["NEBULA_TRAINER_SWITCH_ADDRESS"] == f"switch-{cluster}:7401"
        assert trainer["NEBULA_TRAINER_CLUSTER_ID"] == cluster
    init = " ".join(_command(services["pki-init"]))
    assert "--clusters a,b,c" in init and "pki_export.py" in init


def test_only_switches_and_emulators_are_on_the_wan_and_ports_stay_on_loopback() -> None:
    services = _services()
    on_wan = sorted(name for name, svc in services.items() if "wan" in _networks(svc))
    assert on_wan == ["switch-a", "switch-b", "switch-c", "wan-emulator-b", "wan-emulator-c"]
    for name, svc in services.items():
        for host, _, container_port in _published(svc):
            assert host == "127.0.0.1", f"{name} publishes beyond loopback"
            assert container_port != WAN_PORT, f"{name} publishes the WAN port"
    mounted = {source for svc in services.values() for source, _, _ in _volume_mounts(svc)}
    assert mounted <= set(yaml.safe_load(COMPOSE_3.read_text())["volumes"])
    exported = {source for source, _, _ in _volume_mounts(services["pki-init"])}
    assert {f"switch-{c}-tls" for c in CLUSTERS} | {f"auth-{c}-admin" for c in CLUSTERS} <= exported


def test_pki_export_hands_each_switch_one_crl_per_peer(tmp_path: Path) -> None:
    layout = init_pki(tmp_path / "pki", list(CLUSTERS))
    out = tmp_path / "export"
    for c in CLUSTERS:
        for volume in (
            f"switch-{c}",
            f"auth-{c}",
            *(f"{s}-{c}-internal-tls" for s in ("auth", "codec", "data", "switch", "trainer")),
        ):
            (out / volume).mkdir(parents=True)
    spec = importlib.util.spec_from_file_location("pki_export", ROOT / "docker" / "pki_export.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--pki", str(tmp_path / "pki"), "--out", str(out), "--clusters", "a,b,c"]) == 0
    for cluster in CLUSTERS:
        peers = [c for c in CLUSTERS if c != cluster]
        volume = out / f"switch-{cluster}"
        assert sorted(p.name for p in volume.iterdir()) == sorted(
            ["tls.crt", "tls.key", "trust-bundle.pem", *(f"peer-crl-{p}.pem" for p in peers)]
        )
        for peer in peers:
            assert (volume / f"peer-crl-{peer}.pem").read_bytes() == layout.cluster(peer).crl.read_bytes()
