"""Static checks of the container deployment: docker/Dockerfile, docker-compose.yml and k8s/.

Fast and engine-free: nothing is built or started. They catch drift between the manifests and the
code (every NEBULA_* variable must be a field of that service's settings class, and the values must
pass its validation) and guard the security properties docs/architecture.md promises: only the
switches touch the WAN, internal ports are never exposed, containers run non-root and read-only.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from nebula_common.pki import Identity, identity_from_pem, init_pki
from services.auth.config import AuthSettings
from services.codec.config import CodecSettings
from services.data.config import DataSettings
from services.signer.config import SignerSettings
from services.switch.config import SwitchSettings
from services.trainer.config import TrainerSettings
from tests.support import k8s_schemas

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
K8S = ROOT / "k8s"
OVERLAYS = {"a": K8S / "overlays" / "cluster-a", "b": K8S / "overlays" / "cluster-b"}

# console script -> (settings class, env prefix, gRPC port, health service name)
SERVICES: dict[str, tuple[type, str, int, str]] = {
    "nebula-switch": (SwitchSettings, "NEBULA_SWITCH_", 7400, "nebula.v1.Relay"),
    "nebula-trainer": (TrainerSettings, "NEBULA_TRAINER_", 7500, "nebula.v1.Trainer"),
    "nebula-auth": (AuthSettings, "NEBULA_AUTH_", 7600, "nebula.v1.Auth"),
    "nebula-codec": (CodecSettings, "NEBULA_CODEC_", 7700, "nebula.v1.Codec"),
    "nebula-data": (DataSettings, "NEBULA_DATA_", 7800, "nebula.v1.Data"),
}
# Every process configured by a settings class: the five networked services and the audit signer.
SETTINGS: dict[str, tuple[type, str]] = {
    **{command: (spec[0], spec[1]) for command, spec in SERVICES.items()},
    "nebula-signer": (SignerSettings, "NEBULA_SIGNER_"),
}
AUDITED = ("auth", "data", "switch", "trainer")
"""Services whose audit logs the signer seals (the codec service writes none)."""
# NEBULA_* names that belong to no settings class (read by docker/healthcheck.py).
NON_SETTINGS_VARS = {
    "NEBULA_HEALTH_PORT",
    "NEBULA_HEALTH_SERVICE",
    "NEBULA_HEALTH_TIMEOUT",
    "NEBULA_HEALTH_TLS_CA",
    "NEBULA_HEALTH_SERVER_NAME",
}
WAN_PORT = 7443
METRICS_PORT = 9100
RUNTIME_UID = 10001


# ----------------------------------------------------------------------------- helpers


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _compose_services() -> dict[str, dict[str, Any]]:
    """The default deployment's services (profile services, e.g. `monitoring`: test_monitoring_manifests)."""
    return {name: svc for name, svc in _compose()["services"].items() if not svc.get("profiles")}


def _is_one_shot(svc: dict[str, Any]) -> bool:
    return str(svc.get("restart", "")) == "no"


def _long_running() -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in _compose_services().items() if not _is_one_shot(svc)}


def _command(svc_or_container: dict[str, Any]) -> list[str]:
    command = svc_or_container.get("command") or []
    return [command] if isinstance(command, str) else list(command)


def _compose_env(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


def _networks(svc: dict[str, Any]) -> set[str]:
    networks = svc.get("networks") or []
    return set(networks) if isinstance(networks, list) else set(networks.keys())


def _published(svc: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(host ip, host port, container port) of every ports: entry, short or long syntax."""
    result = []
    for entry in svc.get("ports") or []:
        if isinstance(entry, dict):
            result.append((entry.get("host_ip", ""), int(entry["published"]), int(entry["target"])))
            continue
        parts = str(entry).split("/")[0].split(":")
        if len(parts) == 3:
            result.append((parts[0], int(parts[1]), int(parts[2])))
        elif len(parts) == 2:
            result.append(("", int(parts[0]), int(parts[1])))
        else:
            result.append(("", 0, int(parts[0])))
    return result


def _volume_mounts(svc: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(source, target, read_only) of every volumes: entry in short syntax."""
    mounts = []
    for entry in svc.get("volumes") or []:
        parts = str(entry).split(":")
        mounts.append((parts[0], parts[1], len(parts) > 2 and "ro" in parts[2].split(",")))
    return mounts


def _check_env_names(where: str, command: list[str], names: set[str]) -> None:
    settings_cls, prefix = SETTINGS[command[0]]
    fields = {prefix + name.upper() for name in settings_cls.model_fields}
    for name in sorted(names):
        if not name.startswith("NEBULA_") or name in NON_SETTINGS_VARS:
            continue
        assert name in fields, (
            f"{where}: {name} is not a field of {settings_cls.__name__} "
            f"(known: {sorted(fields)}); a typo or a renamed setting?"
        )
    required = {prefix + name.upper() for name, f in settings_cls.model_fields.items() if f.is_required()}
    assert required <= names, f"{where}: required settings not set: {sorted(required - names)}"


def _build_settings(monkeypatch: pytest.MonkeyPatch, command: list[str], env: dict[str, str]) -> Any:
    """Construct the service's settings exactly as the process would, from these variables only."""
    settings_cls = SETTINGS[command[0]][0]
    with monkeypatch.context() as patch:
        for key in [k for k in os.environ if k.startswith("NEBULA_")]:
            patch.delenv(key)
        for key, value in env.items():
            patch.setenv(key, value)
        return settings_cls()


def _load_k8s_docs() -> list[tuple[Path, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path, doc))
    return docs


def _k8s_kind(kind: str) -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path, doc in _load_k8s_docs() if doc.get("kind") == kind]


def _overlay_config(cluster: str) -> dict[str, str]:
    """The nebula-cluster ConfigMap literals an overlay sets (it replaces the base's)."""
    kustomization = yaml.safe_load((OVERLAYS[cluster] / "kustomization.yaml").read_text())
    (generator,) = [g for g in kustomization["configMapGenerator"] if g["name"] == "nebula-cluster"]
    assert generator.get("behavior") == "replace"
    return dict(literal.split("=", 1) for literal in generator["literals"])


def _k8s_env(container: dict[str, Any], config: dict[str, str]) -> dict[str, str]:
    """The container's environment with configMapKeyRef resolved against ``config``."""
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
            continue
        ref = item["valueFrom"]["configMapKeyRef"]
        assert ref["name"] == "nebula-cluster", f"{item['name']}: unexpected ConfigMap {ref['name']}"
        if ref["key"] in config:
            env[item["name"]] = config[ref["key"]]
        else:
            assert ref.get("optional"), f"{item['name']}: key {ref['key']} missing and not optional"
    return env


def _deployments() -> dict[str, dict[str, Any]]:
    """The base's workloads (Deployments and the trainer's StatefulSet), by name."""
    base = K8S / "base"
    return {
        doc["metadata"]["name"]: doc
        for kind in ("Deployment", "StatefulSet")
        for path, doc in _k8s_kind(kind)
        if base in path.parents
    }


def _containers(*, init: bool = False) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(deployment name, pod spec, container) for every service container of every Deployment.

    ``init``: the init containers too (the audit signer's sidecar and its key adoption).
    """
    result = []
    for name, deployment in _deployments().items():
        pod = deployment["spec"]["template"]["spec"]
        for container in pod["containers"] + (pod.get("initContainers", []) if init else []):
            result.append((name, pod, container))
    return result


# ----------------------------------------------------------------------------- Dockerfile


def test_dockerfile_uses_only_the_local_base_and_pins_torch_first() -> None:
    text = DOCKERFILE.read_text()
    stages = re.findall(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", text, flags=re.MULTILINE | re.IGNORECASE)
    names = {alias.lower() for _, alias in stages if alias}
    for image, _ in stages:
        assert image == "python:3.11-slim" or image.lower() in names, f"unexpected base image {image}"
    assert len(stages) >= 2, "expected a multi-stage build"
    torch = text.index('--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"')
    # The project, with the built-in jobs' text extra, at the locked versions `make install` uses.
    project = text.index('pip install -c constraints.txt ".[text]"')
    assert torch < project, "torch must be installed (pinned) before the project"
    assert re.search(r"^COPY constraints\.txt .*\./$", text, flags=re.MULTILINE)
    assert re.search(r"^ARG TORCH_VERSION=\d+\.\d+\.\d+$", text, flags=re.MULTILINE)
    assert re.search(r"^ARG PIP_FIND_LINKS=$", text, flags=re.MULTILINE)
    assert re.search(r"^ARG TORCH_INDEX_URL=$", text, flags=re.MULTILINE)  # empty: PyPI (CUDA build)
    runtime = text[text.rindex("FROM ") :]
    assert f"USER {RUNTIME_UID}" in runtime
    assert "HEALTHCHECK" in runtime and "healthcheck.py" in runtime


def test_dockerignore_keeps_the_venv_and_runs_out_of_the_context() -> None:
    entries = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "runs", "**/__pycache__", ".pytest_cache"} <= entries


# ----------------------------------------------------------------------------- compose


def test_compose_builds_one_image_and_never_pulls() -> None:
    services = _compose_services()
    builders = [name for name, svc in services.items() if "build" in svc]
    assert len(builders) == 1, f"exactly one service should build the shared image, got {builders}"
    build = services[builders[0]]["build"]
    assert build["dockerfile"] == "docker/Dockerfile"
    assert build["args"]["PIP_FIND_LINKS"] == "${PIP_FIND_LINKS:-}"
    assert build["args"]["TORCH_INDEX_URL"] == "${TORCH_INDEX_URL:-}"
    for name, svc in services.items():
        assert svc["image"] == "localhost/nebula:dev", name
        if name not in builders:
            assert svc.get("pull_policy") == "never", f"{name} would try to pull from a registry"


def test_only_switches_and_the_wan_emulator_are_on_the_wan() -> None:
    services = _compose_services()
    on_wan = {name for name, svc in services.items() if "wan" in _networks(svc)}
    switches = {name for name, svc in services.items() if _command(svc)[:1] == ["nebula-switch"]}
    assert switches == {"switch-a", "switch-b"}
    assert on_wan == switches | {"wan-emulator"}
    assert _networks(services["wan-emulator"]) == {"wan"}
    for cluster in ("a", "b"):
        assert _networks(services[f"switch-{cluster}"]) == {f"cluster_{cluster}", "wan"}
        for role in ("auth", "codec", "trainer"):
            assert _networks(services[f"{role}-{cluster}"]) == {f"cluster_{cluster}"}, f"{role}-{cluster}"
    assert services["pki-init"].get("network_mode") == "none"


def test_every_long_running_service_has_a_healthcheck() -> None:
    for name, svc in _long_running().items():
        check = svc.get("healthcheck")
        assert check and not check.get("disable") and check.get("test"), f"{name} has no healthcheck"
        command = _command(svc)
        if command[0] in SERVICES:
            _, _, port, service = SERVICES[command[0]]
            env = _compose_env(svc)
            assert env["NEBULA_HEALTH_PORT"] == str(port), name
            assert env["NEBULA_HEALTH_SERVICE"] == service, name


def test_nothing_is_published_beyond_loopback_and_never_the_wan_port() -> None:
    allowed = {
        "nebula-switch": {7400, METRICS_PORT},
        "nebula-trainer": {7500},
        "nebula-auth": {7600},
        "nebula-data": {7800},  # its client port (TLS + token): `nebula account grants` from the host
    }
    host_ports = []
    for name, svc in _compose_services().items():
        published = _published(svc)
        for host_ip, host_port, container_port in published:
            assert host_ip == "127.0.0.1", f"{name} publishes {container_port} beyond loopback"
            assert container_port != WAN_PORT, f"{name} publishes the WAN port to the host"
            assert container_port in allowed.get(_command(svc)[0], set()), (
                f"{name} publishes {container_port}, which the SDK on the host does not need"
            )
            host_ports.append(host_port)
    assert len(host_ports) == len(set(host_ports)), "two services publish the same host port"
    assert host_ports, "the SDK on the host needs the trainer, auth and switch ports"


def test_compose_services_are_hardened() -> None:
    for name, svc in _compose_services().items():
        assert svc.get("read_only") is True, f"{name}: root filesystem must be read-only"
        assert svc.get("cap_drop") == ["ALL"], f"{name}: must drop all capabilities"
        assert "no-new-privileges:true" in svc.get("security_opt", []), name
        assert svc["deploy"]["resources"]["limits"]["memory"], f"{name}: no memory limit"
        if _is_one_shot(svc):
            continue
        assert str(svc.get("user")).split(":")[0] == str(RUNTIME_UID), f"{name} must run as {RUNTIME_UID}"
        assert not svc.get("cap_add"), f"{name} must not add capabilities"
        assert any(str(t).startswith("/tmp") for t in svc.get("tmpfs", [])), f"{name}: no tmpfs for /tmp"
    pki = _compose_services()["pki-init"]
    assert pki.get("cap_add") == ["CHOWN"], "pki-init needs CHOWN only, to hand files to the services"


def test_secrets_reach_only_their_own_service() -> None:
    services = _compose_services()
    pki_users = [
        name for name, svc in services.items() if any(src == "pki" for src, _, _ in _volume_mounts(svc))
    ]
    assert pki_users == ["pki-init"], "only pki-init may mount the CA store"
    for name, svc in services.items():
        if name == "pki-init":
            continue
        for source, target, read_only in _volume_mounts(svc):
            if source.endswith(("-tls", "-admin")):
                assert read_only, f"{name} mounts {source} writable"
                assert source.startswith(name + "-"), f"{name} mounts another service's secrets {source}"
                assert target.startswith("/etc/nebula/")
            elif source.endswith("-data"):
                # auth keeps accounts and keys; the switch its audit log; data the datasets; the
                # trainer its checkpoints, stage records and audit trail. The signer's one-shot init
                # moves the audit keys older deployments kept there (its own cluster's only).
                owner_ok = name.startswith(("auth-", "switch-", "data-", "trainer-"))
                init_ok = name.startswith("signer-init-") and source.endswith(f"-{name[-1]}-data")
                assert (source == f"{name}-data" and owner_ok) or init_ok, f"{name} mounts {source}"
            elif source.endswith("-keys"):  # the audit seal keys: the signer and its init only
                cluster = source.removeprefix("signer-").removesuffix("-keys")
                assert name in (f"signer-{cluster}", f"signer-init-{cluster}"), f"{name} mounts {source}"
                assert target == "/var/lib/nebula/signer", name
            elif source.endswith("-signer"):  # a service's socket to its signer: it and the signer
                service, cluster = source.removesuffix("-signer").rsplit("-", 1)
                if name == f"signer-{cluster}":
                    assert target == f"/var/lib/nebula/signer-sockets/{service}", name
                else:
                    assert name == f"{service}-{cluster}", f"{name} mounts {source}"
                    assert read_only and target == "/var/lib/nebula/audit-signer", name
            elif source.endswith("-edges"):  # a switch's edge socket: it and its cluster's trainer
                cluster = source.removeprefix("switch-").removesuffix("-edges")
                assert (name, read_only) in ((f"switch-{cluster}", False), (f"trainer-{cluster}", True)), (
                    f"{name} mounts {source}" + (" read-only" if read_only else "")
                )
                assert target == "/var/lib/nebula/edges", name  # tests/unit/test_edge_carriers.py
            else:
                pytest.fail(f"{name} mounts unexpected volume {source}")
    declared = set(_compose()["volumes"])
    every = [mount for svc in _compose()["services"].values() for mount in _volume_mounts(svc)]
    used = {src for src, _, _ in every if not src.startswith((".", "/"))}  # named volumes, not bind mounts
    assert used == declared  # profile services' volumes included


def test_compose_env_names_are_settings_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = set()
    for name, svc in _compose_services().items():
        command = _command(svc)
        env = _compose_env(svc)
        if command[0] not in SETTINGS:
            owned = {k for k in env if k.startswith("NEBULA_")} - NON_SETTINGS_VARS
            assert not owned, f"{name} runs no Nebula service but sets {owned}"
            continue
        seen.add(command[0])
        _check_env_names(f"compose {name}", command, set(env))
        settings = _build_settings(monkeypatch, command, env)  # values pass the service's validation
        assert settings.cluster_id == name.rsplit("-", 1)[1]
        # The signer has no network (and so no /metrics); every other service serves its metrics.
        assert settings.metrics_port == (-1 if command[0] == "nebula-signer" else METRICS_PORT)
    assert seen == set(SETTINGS)


def test_compose_audit_logs_are_sealed_by_the_clusters_signer(monkeypatch: pytest.MonkeyPatch) -> None:
    """No audited service holds its seal key: each asks its cluster's signer on a socket only it shares."""
    services = _compose_services()
    for cluster in ("a", "b"):
        signer = services[f"signer-{cluster}"]
        assert signer.get("network_mode") == "none", "the signer needs no network"
        sockets = _build_settings(monkeypatch, ["nebula-signer"], _compose_env(signer)).socket_map()
        assert set(sockets) == set(AUDITED)
        signer_mounts = {source: target for source, target, _ in _volume_mounts(signer)}
        for service in AUDITED:
            name = f"{service}-{cluster}"
            settings = _build_settings(monkeypatch, [f"nebula-{service}"], _compose_env(services[name]))
            assert settings.audit_signer == "unix:/var/lib/nebula/audit-signer/signer.sock", name
            mounts = {source: target for source, target, _ in _volume_mounts(services[name])}
            assert mounts[f"{name}-signer"] == "/var/lib/nebula/audit-signer", name
            assert sockets[service].parent == Path(signer_mounts[f"{name}-signer"]), name
        health = signer["healthcheck"]["test"]
        assert health[health.index("--unix") + 1 :] == [str(path) for path in sockets.values()]
        adopt = services[f"signer-init-{cluster}"]
        assert _command(adopt)[:3] == ["python", "-m", "services.signer.adopt"]
        assert adopt.get("network_mode") == "none" and str(adopt["user"]).startswith(str(RUNTIME_UID))
        moved = dict(entry.split("=", 1) for entry in _command(adopt)[5:])
        assert set(moved) == set(AUDITED)
        for service, directory in moved.items():
            data = _compose_env(services[f"{service}-{cluster}"])[f"NEBULA_{service.upper()}_DATA_DIR"]
            assert directory == data and (f"{service}-{cluster}-data", data, False) in _volume_mounts(adopt)


def test_compose_wan_link_wiring(monkeypatch: pytest.MonkeyPatch) -> None:
    services = _compose_services()
    a = _build_settings(monkeypatch, ["nebula-switch"], _compose_env(services["switch-a"]))
    b = _build_settings(monkeypatch, ["nebula-switch"], _compose_env(services["switch-b"]))
    assert (a.peer_cluster_id, b.peer_cluster_id) == ("b", "a")
    assert a.dials() and not b.dials(), "cluster a sorts first: it dials, b accepts"
    assert a.peer_address == "wan-emulator:7000"
    emulator = _command(services["wan-emulator"])
    assert emulator[emulator.index("--target") + 1] == f"switch-b:{WAN_PORT}"
    assert emulator[emulator.index("--listen") + 1] == "0.0.0.0:7000"
    assert emulator[emulator.index("--control") + 1].startswith("127.0.0.1:")  # fault controls, loopback only
    assert b.wan_listen.endswith(f":{WAN_PORT}")
    assert a.link_carrier == b.link_carrier == "records", "compose runs the default link carrier"
    for cluster in ("a", "b"):
        # Service to service: the mutual-TLS service ports (client port + 1), docs/internal-tls.md.
        trainer = _compose_env(services[f"trainer-{cluster}"])
        assert trainer["NEBULA_TRAINER_SWITCH_ADDRESS"] == f"switch-{cluster}:7401"
        assert trainer["NEBULA_TRAINER_AUTH_ADDRESS"] == f"auth-{cluster}:7601"
        assert trainer["NEBULA_TRAINER_DATA_SERVICE_ADDRESS"] == f"data-{cluster}:7801"
        switch = _compose_env(services[f"switch-{cluster}"])
        assert switch["NEBULA_SWITCH_AUTH_ADDRESS"] == f"auth-{cluster}:7601"
        assert switch["NEBULA_SWITCH_SERVICE_LISTEN"] == "0.0.0.0:7401"
    # Revocation is enforced: each switch reads its peer's CRL from its own read-only TLS volume.
    for cluster, settings in (("a", a), ("b", b)):
        assert settings.peer_crl is not None, f"switch-{cluster} has no NEBULA_SWITCH_PEER_CRL"
        mounts = {target: source for source, target, _ in _volume_mounts(services[f"switch-{cluster}"])}
        assert mounts[str(settings.peer_crl.parent)] == f"switch-{cluster}-tls"
    init = " ".join(_command(services["pki-init"]))
    assert "pki_export.py" in init and "--clusters a,b" in init


def test_pki_export_hands_each_switch_its_peers_crl(tmp_path: Path) -> None:
    """Run docker/pki_export.py on a real PKI: switch-a gets b's CRL and vice versa, nothing else."""
    layout = init_pki(tmp_path / "pki", ["a", "b"])
    out = tmp_path / "export"
    internal = [
        f"{svc}-{c}-internal-tls" for c in "ab" for svc in ("auth", "codec", "data", "switch", "trainer")
    ]
    for volume in ("switch-a", "switch-b", "auth-a", "auth-b", *internal):
        (out / volume).mkdir(parents=True)
    spec = importlib.util.spec_from_file_location("pki_export", ROOT / "docker" / "pki_export.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--pki", str(tmp_path / "pki"), "--out", str(out), "--clusters", "a,b"]) == 0
    for cluster, peer in (("a", "b"), ("b", "a")):
        volume = out / f"switch-{cluster}"
        assert sorted(p.name for p in volume.iterdir()) == [
            "peer-crl.pem",
            "tls.crt",
            "tls.key",
            "trust-bundle.pem",
        ]
        assert (volume / "peer-crl.pem").read_bytes() == layout.cluster(cluster).trust_crl(peer).read_bytes()
        assert (volume / "peer-crl.pem").read_bytes() == layout.cluster(peer).crl.read_bytes()
        assert (volume / "peer-crl.pem").stat().st_mode & 0o777 == 0o400
    # Each service gets its own internal identity of its own cluster, and the CA to verify peers.
    for name in internal:
        service, cluster = name.split("-")[:2]
        volume = out / name
        assert sorted(p.name for p in volume.iterdir()) == ["ca.crt", "crl.pem", "service.crt", "service.key"]
        assert identity_from_pem((volume / "service.crt").read_bytes()) == Identity(cluster, service)
        assert (volume / "ca.crt").read_bytes() == layout.cluster(cluster).ca_cert.read_bytes()
        assert (volume / "crl.pem").read_bytes() == layout.cluster(cluster).crl.read_bytes()
        assert (volume / "service.key").stat().st_mode & 0o777 == 0o400
    # No rank workers mounted here: no worker identity exported anywhere.
    assert not (out / "worker-a-internal-tls").exists()


def test_pki_export_issues_the_rank_workers_identity_only_where_it_is_mounted(tmp_path: Path) -> None:
    layout = init_pki(tmp_path / "pki", ["a", "b"])
    out = tmp_path / "export"
    internal = [
        f"{svc}-{c}-internal-tls" for c in "ab" for svc in ("auth", "codec", "data", "switch", "trainer")
    ]
    for volume in ("switch-a", "switch-b", "auth-a", "auth-b", *internal, "worker-a-internal-tls"):
        (out / volume).mkdir(parents=True)
    assert _load_pki_export().main(["--pki", str(layout.root), "--out", str(out), "--clusters", "a,b"]) == 0
    volume = out / "worker-a-internal-tls"
    assert sorted(p.name for p in volume.iterdir()) == ["ca.crt", "service.crt", "service.key"]
    assert identity_from_pem((volume / "service.crt").read_bytes()) == Identity("a", "worker")
    assert (volume / "service.key").stat().st_mode & 0o777 == 0o400
    assert not (out / "worker-b-internal-tls").exists()


def _load_pki_export() -> Any:
    spec = importlib.util.spec_from_file_location("pki_export", ROOT / "docker" / "pki_export.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_service_enforces_its_clusters_crl_in_compose(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each service reads the cluster CA's CRL from its own internal-tls volume (pki-init puts it there)."""
    for name, svc in _long_running().items():
        command = _command(svc)
        if command[0] not in SERVICES:
            continue
        settings = _build_settings(monkeypatch, command, _compose_env(svc))
        assert settings.internal_crl == Path("/etc/nebula/internal-tls/crl.pem"), name
        mounts = {target: (source, ro) for source, target, ro in _volume_mounts(svc)}
        assert mounts["/etc/nebula/internal-tls"] == (f"{name}-internal-tls", True), name


def test_pki_init_rerun_after_a_revocation_hands_every_service_the_new_crl(tmp_path: Path) -> None:
    """`nebula pki revoke`, then pki-init again: every service's crl.pem lists the serial, CA-signed."""
    from cryptography import x509

    from nebula_common.pki.lifecycle import revoke_certificate

    init_pki(tmp_path / "pki", ["a", "b"])
    out = tmp_path / "export"
    for volume in ("switch-a", "switch-b", "auth-a", "auth-b"):
        (out / volume).mkdir(parents=True)
    for c in "ab":
        for svc in ("auth", "codec", "data", "switch", "trainer"):
            (out / f"{svc}-{c}-internal-tls").mkdir()
    pki_export = _load_pki_export()
    args = ["--pki", str(tmp_path / "pki"), "--out", str(out), "--clusters", "a,b"]
    assert pki_export.main(args) == 0
    codec = x509.load_pem_x509_certificate((out / "codec-a-internal-tls" / "service.crt").read_bytes())
    auth_before = (out / "auth-a-internal-tls" / "service.crt").read_bytes()
    revoke_certificate(tmp_path / "pki", "a", codec.serial_number, reason="test")
    assert pki_export.main(args) == 0  # the compose way to publish a revocation
    renewed = x509.load_pem_x509_certificate((out / "codec-a-internal-tls" / "service.crt").read_bytes())
    assert renewed.serial_number != codec.serial_number, "the revoked leaf must be replaced, not re-exported"
    assert (out / "auth-a-internal-tls" / "service.crt").read_bytes() == auth_before, "a good leaf is kept"
    for svc in ("auth", "codec", "data", "switch", "trainer"):
        for c in "ab":
            volume = out / f"{svc}-{c}-internal-tls"
            crl = x509.load_pem_x509_crl((volume / "crl.pem").read_bytes())
            ca = x509.load_pem_x509_certificate((volume / "ca.crt").read_bytes())
            assert crl.is_signature_valid(ca.public_key()), volume  # type: ignore[arg-type]
            listed = {entry.serial_number for entry in crl}
            assert (codec.serial_number in listed) == (c == "a"), volume
            assert (volume / "crl.pem").stat().st_mode & 0o777 == 0o400


def test_compose_start_order() -> None:
    services = _compose_services()

    def deps(name: str) -> dict[str, str]:
        return {dep: spec["condition"] for dep, spec in (services[name].get("depends_on") or {}).items()}

    for name in services:
        for dep, condition in deps(name).items():
            one_shot = dep == "pki-init" or dep.startswith("signer-init-")
            expected = "service_completed_successfully" if one_shot else "service_healthy"
            assert condition == expected, f"{name} -> {dep}: {condition}"
    for cluster in ("a", "b"):
        assert {"pki-init", f"auth-{cluster}"} <= set(deps(f"switch-{cluster}"))
        assert {f"auth-{cluster}", f"switch-{cluster}"} <= set(deps(f"trainer-{cluster}"))
        assert "pki-init" in deps(f"auth-{cluster}")
        assert f"signer-init-{cluster}" in deps(f"signer-{cluster}")
        for service in AUDITED:
            assert f"signer-{cluster}" in deps(f"{service}-{cluster}"), (
                f"{service}-{cluster} before its signer"
            )
    assert "switch-b" in deps("wan-emulator") and "wan-emulator" in deps("switch-a")


# ----------------------------------------------------------------------------- Kubernetes


def test_every_k8s_yaml_parses_and_has_a_kind() -> None:
    docs = _load_k8s_docs()
    assert docs
    for path, doc in docs:
        assert doc.get("apiVersion") and doc.get("kind"), f"{path}: not a Kubernetes/kustomize object"
    kinds = {doc["kind"] for _, doc in docs}
    assert {
        "Deployment",
        "StatefulSet",
        "Service",
        "NetworkPolicy",
        "PersistentVolumeClaim",
        "Kustomization",
    } <= kinds
    assert set(_deployments()) == set(SERVICES)


def test_k8s_containers_are_non_root_read_only_and_bounded() -> None:
    for name, pod, container in _containers(init=True):
        pod_ctx = pod["securityContext"]
        assert pod_ctx["runAsNonRoot"] is True and pod_ctx["runAsUser"] == RUNTIME_UID, name
        assert pod_ctx["seccompProfile"]["type"] == "RuntimeDefault", name
        assert pod.get("automountServiceAccountToken") is False, name
        # Service links would inject NEBULA_<SERVICE>_* variables next to our settings.
        assert pod.get("enableServiceLinks") is False, name
        ctx = container["securityContext"]
        assert ctx["readOnlyRootFilesystem"] is True, name
        assert ctx["allowPrivilegeEscalation"] is False, name
        assert ctx["capabilities"]["drop"] == ["ALL"] and not ctx["capabilities"].get("add"), name
        resources = container["resources"]
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(resources[kind]), f"{name}: {kind}"
        mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
        assert "/tmp" in mounts, f"{name}: read-only root needs a writable /tmp"


def test_crashed_services_are_restarted_by_compose_and_kubernetes() -> None:
    """Crashes heal: compose restarts every long-running service, Kubernetes every pod.

    ``unless-stopped`` (not ``on-failure``): a service killed by a signal or OOM, or one that exits 0
    unexpectedly, comes back too, while one an operator stopped stays stopped.
    """
    services = _compose_services()
    one_shot = sorted(name for name, svc in services.items() if _is_one_shot(svc))
    assert one_shot == ["pki-init", "signer-init-a", "signer-init-b"], one_shot
    for name, svc in _long_running().items():
        assert svc.get("restart") == "unless-stopped", f"{name}: restart is {svc.get('restart')!r}"
    deployments = _deployments()
    assert {c["command"][0] for _, _, c in _containers()} == set(SERVICES)
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]["spec"]
        assert pod.get("restartPolicy", "Always") == "Always", name
        for container in pod["containers"]:
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                assert "grpc" in container.get(probe, {}), f"{name}: {probe} missing"


def test_k8s_probes_are_native_grpc_on_the_service_port() -> None:
    """Native gRPC probes cannot speak TLS: they ask the plaintext health-only port (gRPC port + 9)."""
    for name, _, container in _containers():
        _, prefix, port, service = SERVICES[container["command"][0]]
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            grpc = container[probe]["grpc"]
            assert grpc == {"port": port + 9, "service": service}, f"{name} {probe}"
        ports = {p["containerPort"] for p in container["ports"]}
        assert {port, port + 1, port + 9, METRICS_PORT} <= ports, name
        env = {item["name"]: item.get("value", "") for item in container["env"]}
        assert env[prefix + "HEALTH_LISTEN"] == f"0.0.0.0:{port + 9}", name
        assert env[prefix + "SERVICE_LISTEN"] == f"0.0.0.0:{port + 1}", name
        assert env[prefix + "INTERNAL_TLS_DIR"] == "/etc/nebula/internal-tls", name


def test_k8s_env_names_are_settings_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = set()
    for cluster in OVERLAYS:
        config = _overlay_config(cluster)
        for name, _, container in _containers():
            command = container["command"]
            env = _k8s_env(container, config)
            declared = {item["name"] for item in container.get("env", [])}
            _check_env_names(f"k8s {name} (cluster {cluster})", command, declared)
            settings = _build_settings(monkeypatch, command, env)
            assert settings.cluster_id == cluster
            assert settings.metrics_port == METRICS_PORT
            seen.add(command[0])
    assert seen == set(SERVICES)


def test_k8s_overlays_wire_the_link(monkeypatch: pytest.MonkeyPatch) -> None:
    (switch,) = [c for n, _, c in _containers() if n == "nebula-switch"]
    a = _build_settings(monkeypatch, ["nebula-switch"], _k8s_env(switch, _overlay_config("a")))
    b = _build_settings(monkeypatch, ["nebula-switch"], _k8s_env(switch, _overlay_config("b")))
    assert (a.cluster_id, a.peer_cluster_id, b.cluster_id, b.peer_cluster_id) == ("a", "b", "b", "a")
    assert a.dials() and a.peer_address.endswith(f":{WAN_PORT}")
    assert not b.dials() and b.peer_address is None
    assert a.wan_listen == b.wan_listen == f"0.0.0.0:{WAN_PORT}"
    assert a.peer_crl == b.peer_crl == Path("/etc/nebula/tls/peer-crl.pem"), "switch enforces no CRL"
    assert a.link_carrier == b.link_carrier == "records", "k8s runs the default link carrier"


def test_k8s_audit_logs_are_sealed_by_a_signer_sidecar(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each audited pod runs the audit signer beside its service: the key on a claim only it mounts.

    The signer is a native sidecar (an init container that keeps running), so it listens before the
    service starts; the service reaches it only through the socket in an emptyDir the two share, and
    the claim holding the key is mounted by the signer and the one-shot that adopts an older key.
    """
    config = _overlay_config("a")
    deployments = _deployments()
    for service in AUDITED:
        name = f"nebula-{service}"
        pod = deployments[name]["spec"]["template"]["spec"]
        assert not pod.get("shareProcessNamespace"), f"{name}: the service would see the signer's process"
        adopt, signer = pod["initContainers"]
        (main,) = pod["containers"]
        assert adopt["command"][:3] == ["python", "-m", "services.signer.adopt"], name
        assert signer["command"] == ["nebula-signer"] and signer.get("restartPolicy") == "Always", name
        for probe in ("startupProbe", "livenessProbe"):
            assert signer[probe]["exec"]["command"][2] == "--unix", f"{name} signer {probe}"
        _check_env_names(f"k8s {name} signer", signer["command"], {e["name"] for e in signer["env"]})
        settings = _build_settings(monkeypatch, signer["command"], _k8s_env(signer, config))
        assert settings.cluster_id == "a" and list(settings.socket_map()) == [service], name
        socket = settings.socket_map()[service]

        def mounts(container: dict[str, Any]) -> dict[str, tuple[str, bool]]:
            return {m["name"]: (m["mountPath"], m.get("readOnly", False)) for m in container["volumeMounts"]}

        keys_readers = [
            c["name"] for c in pod["initContainers"] + pod["containers"] if "signer-keys" in mounts(c)
        ]
        assert keys_readers == ["adopt-audit-key", "signer"], f"{name}: {keys_readers} mount the seal key"
        assert mounts(signer)["signer-keys"] == (str(settings.data_dir), False), name
        shared, _ = mounts(signer)["signer-socket"]
        seen, read_only = mounts(main)["signer-socket"]
        assert read_only and socket.is_relative_to(shared), name
        main_settings = _build_settings(monkeypatch, main["command"], _k8s_env(main, config))
        assert main_settings.audit_signer == f"unix:{Path(seen) / socket.relative_to(shared)}", name
        assert "tmp" not in mounts(signer) and "signer-tmp" not in mounts(main), name  # no /tmp shared
        data_dir = Path(str(main_settings.data_dir))
        assert adopt["command"][-1] == f"{service}={data_dir}" and mounts(adopt)["data"] == (
            str(data_dir),
            False,
        )
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in volumes["signer-socket"], name
        templates = [t["metadata"]["name"] for t in deployments[name]["spec"].get("volumeClaimTemplates", [])]
        if "signer-keys" not in templates:
            assert volumes["signer-keys"]["persistentVolumeClaim"]["claimName"] == f"{name}-signer", name


def test_k8s_secrets_are_mounted_read_only() -> None:
    deployments = _deployments()
    expected = {
        "nebula-switch": ("nebula-switch-tls", {"tls.crt", "tls.key", "trust-bundle.pem", "peer-crl.pem"}),
        "nebula-auth": ("nebula-auth-admin", {"admin-password"}),
    }
    for name in SERVICES:
        service = name.removeprefix("nebula-")
        pod = deployments[name]["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "internal-tls"]
        sources = volume["projected"]["sources"]
        (secret,) = [s["secret"] for s in sources if "secret" in s]
        assert secret["name"] == f"nebula-{service}-internal-tls"
        assert {item["key"] for item in secret["items"]} == {"ca.crt", "service.crt", "service.key"}
        assert volume["projected"]["defaultMode"] & 0o007 == 0
        (container,) = pod["containers"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
        assert mount["readOnly"] is True and mount["mountPath"] == "/etc/nebula/internal-tls"
    for name, (secret, keys) in expected.items():
        pod = deployments[name]["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == secret]
        assert volume["secret"]["secretName"] == secret
        assert {item["key"] for item in volume["secret"]["items"]} == keys
        assert volume["secret"]["defaultMode"] & 0o007 == 0, f"{secret} readable by others"
        (container,) = pod["containers"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
        assert mount["readOnly"] is True
        env = {item["name"]: item.get("value", "") for item in container["env"]}
        for value in env.values():
            if value.startswith("/etc/nebula/") and not value.startswith("/etc/nebula/internal-tls"):
                assert value.startswith(mount["mountPath"] + "/") and value.rsplit("/", 1)[1] in keys
    auth = deployments["nebula-auth"]["spec"]["template"]["spec"]
    claims = [
        v["persistentVolumeClaim"]["claimName"] for v in auth["volumes"] if "persistentVolumeClaim" in v
    ]
    assert claims == ["nebula-auth-data", "nebula-auth-signer"]
    for _, doc in _k8s_kind("Secret"):
        pytest.fail(f"secret {doc['metadata']['name']} committed to k8s/: create it at deploy time")


def test_k8s_services_enforce_the_clusters_crl(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CRL ConfigMap is projected next to each service's identity, and the service is told to read it."""
    for name, pod, container in _containers():
        (volume,) = [v for v in pod["volumes"] if v["name"] == "internal-tls"]
        (config_map,) = [s["configMap"] for s in volume["projected"]["sources"] if "configMap" in s]
        assert config_map["name"] == "nebula-internal-crl", name
        assert config_map["items"] == [{"key": "crl.pem", "path": "crl.pem"}], name
        assert not config_map.get("optional"), f"{name}: a missing CRL must stop the pod, not pass silently"
        for cluster in OVERLAYS:
            settings = _build_settings(
                monkeypatch, container["command"], _k8s_env(container, _overlay_config(cluster))
            )
            assert settings.internal_crl == Path("/etc/nebula/internal-tls/crl.pem"), name


def test_only_the_switch_wan_port_leaves_the_cluster() -> None:
    services = {doc["metadata"]["name"]: doc["spec"] for _, doc in _k8s_kind("Service")}
    for name, spec in services.items():
        if name == "nebula-switch-wan":
            assert spec["type"] in {"LoadBalancer", "NodePort"}
            assert [p["port"] for p in spec["ports"]] == [WAN_PORT]
        else:
            assert spec.get("type", "ClusterIP") == "ClusterIP", f"{name} must stay cluster-internal"
            assert WAN_PORT not in {p["port"] for p in spec["ports"]}


def test_network_policies_deny_by_default() -> None:
    policies = {doc["metadata"]["name"]: doc["spec"] for _, doc in _k8s_kind("NetworkPolicy")}
    defaults = [
        spec
        for spec in policies.values()
        if spec["podSelector"] == {} and spec["policyTypes"] == ["Ingress"] and not spec.get("ingress")
    ]
    assert defaults, "no default-deny ingress NetworkPolicy"
    wide_open = []
    for name, spec in policies.items():
        for rule in spec.get("ingress", []):
            ports = {p["port"] for p in rule.get("ports", [])}
            assert ports, f"{name}: a rule without ports allows every port"
            sources = rule.get("from")
            if not sources:
                wide_open.append((name, ports, spec["podSelector"]))
                continue
            for source in sources:
                assert set(source) == {"podSelector"}, f"{name}: ingress from outside the namespace"
    assert wide_open == [
        ("nebula-allow-switch-wan", {WAN_PORT}, {"matchLabels": {"app.kubernetes.io/name": "nebula-switch"}})
    ], "only the switch WAN port may accept traffic from anywhere"


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_kustomize_builds(overlay: str) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed; the YAML structure is still checked above")
    result = subprocess.run(
        [kubectl, "kustomize", str(OVERLAYS[overlay])], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    rendered = [d for d in yaml.safe_load_all(result.stdout) if d]
    invalid = [error for doc in rendered for error in k8s_schemas.errors(doc)]  # strict: unknown fields too
    assert not invalid, "\n".join(invalid)
    assert {d["metadata"].get("namespace") for d in rendered if d["kind"] != "Namespace"} == {"nebula"}
    # The Nebula services (the monitoring component: tests/unit/test_monitoring_manifests.py).
    docs = [
        d for d in rendered if not d["metadata"]["name"].startswith(("nebula-prometheus", "nebula-grafana"))
    ]
    claims = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    services = ("auth", "data", "switch")
    assert sorted(claims) == sorted(f"nebula-{s}-{kind}" for s in services for kind in ("data", "signer"))
    # The trainer's claim is one per pod, from its StatefulSet's template (data-nebula-trainer-0).
    (trainer,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "nebula-trainer"]
    claims.update({t["metadata"]["name"]: t["spec"] for t in trainer["spec"]["volumeClaimTemplates"]})
    for claim in claims.values():
        assert claim["accessModes"] == ["ReadWriteOnce"]
        assert claim["resources"]["requests"]["storage"]
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert config["data"]["cluster_id"] == overlay
    for deployment in (d for d in docs if d["kind"] == "Deployment"):  # the rendered CRL mount
        pod = deployment["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "internal-tls"]
        assert {
            "configMap": {"name": "nebula-internal-crl", "items": [{"key": "crl.pem", "path": "crl.pem"}]}
        } in (volume["projected"]["sources"])
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert "/etc/nebula/internal-tls/crl.pem" in {
            v for k, v in env.items() if k.endswith("_INTERNAL_CRL")
        }


STATEFUL = {"nebula-auth", "nebula-data", "nebula-switch", "nebula-trainer"}


def test_service_state_lives_on_named_volumes_and_persistent_volume_claims() -> None:
    """Checkpoints, audit logs, keys and seals outlive a container: never on /tmp or an emptyDir.

    Every service with state (a ``*_DATA_DIR`` setting) has that directory on its own named volume in
    compose and on a PersistentVolumeClaim in Kubernetes; the image creates the mount point owned by
    the runtime user, so a fresh volume is writable by it.
    """
    volumes = set(_compose()["volumes"])
    for name, svc in _long_running().items():
        data_dirs = [v for k, v in _compose_env(svc).items() if k.endswith("_DATA_DIR")]
        if _command(svc)[0] not in STATEFUL | {"nebula-signer"}:
            assert not data_dirs, name
            continue
        assert len(data_dirs) == 1, f"{name}: no data directory setting"
        volume = f"{name}-keys" if _command(svc)[0] == "nebula-signer" else f"{name}-data"
        mounts = {target: source for source, target, read_only in _volume_mounts(svc) if not read_only}
        assert mounts.get(data_dirs[0]) == volume and volume in volumes, name
        assert f" {data_dirs[0]}" in DOCKERFILE.read_text(), f"image lacks the mount point {data_dirs[0]}"
    claims = {doc["metadata"]["name"] for _, doc in _k8s_kind("PersistentVolumeClaim")}
    stateful_seen = set()
    for name, pod, container in _containers(init=True):  # the signers' keys included
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        data_dirs = [v for k, v in env.items() if k.endswith("_DATA_DIR")]
        if container["command"][0] in STATEFUL:
            stateful_seen.add(container["command"][0])
            assert len(data_dirs) == 1, f"{name}: no data directory setting"
        pod_volumes = {v["name"]: v for v in pod.get("volumes", [])}
        templates = {
            t["metadata"]["name"] for t in _deployments()[name]["spec"].get("volumeClaimTemplates", [])
        }
        mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
        for data_dir in data_dirs:
            if mounts[data_dir] in templates:  # a StatefulSet's claim per pod
                continue
            volume = pod_volumes[mounts[data_dir]]
            assert volume.get("persistentVolumeClaim", {}).get("claimName") in claims, f"{name}: {volume}"
    assert stateful_seen == STATEFUL


def test_every_console_script_is_copied_into_the_runtime_image() -> None:
    """A service whose entry point is missing from the image dies at start with 'failed to exec pid1'."""
    import tomllib

    scripts = tomllib.loads((DOCKERFILE.parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    runtime = DOCKERFILE.read_text()[DOCKERFILE.read_text().rindex("FROM ") :]
    copied = " ".join(
        line for line in runtime.replace("\\\n", " ").splitlines() if line.startswith("COPY --from=build")
    )
    missing = [name for name in scripts if f"/usr/local/bin/{name} " not in copied + " "]
    assert not missing, f"console scripts not copied into the runtime image: {missing}"
