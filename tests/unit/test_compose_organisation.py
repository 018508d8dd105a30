"""docker/compose-organisation.yml: one organisation's cluster, parameterised by its peer's address.

Engine-free, like test_deploy_manifests: the file is interpolated as compose would for organisation
``a`` (dials ``b``) and ``b`` (accepts), and every service's NEBULA_* environment must build that
service's settings class. Also checked: only the switch leaves the cluster, only its WAN port is
published beyond loopback, no service mounts the PKI (only the one-shot export reads it), and
pki_export's organisation mode hands the switch its own CRL and nothing of the peer but its CA.
"""

from __future__ import annotations

import importlib.util
import re
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

from nebula_common.pki.store import add_trust, init_cluster
from services.auth.config import AuthSettings
from services.codec.config import CodecSettings
from services.data.config import DataSettings
from services.signer.config import SignerSettings
from services.switch.config import SwitchSettings
from services.trainer.config import TrainerSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker" / "compose-organisation.yml"
SETTINGS = {
    "nebula-auth": (AuthSettings, "NEBULA_AUTH_"),
    "nebula-data": (DataSettings, "NEBULA_DATA_"),
    "nebula-codec": (CodecSettings, "NEBULA_CODEC_"),
    "nebula-switch": (SwitchSettings, "NEBULA_SWITCH_"),
    "nebula-trainer": (TrainerSettings, "NEBULA_TRAINER_"),
    "nebula-signer": (SignerSettings, "NEBULA_SIGNER_"),
}
ONE_SHOT = ("pki-export", "signer-init")
ORGS = {
    "a": {"NEBULA_CLUSTER": "a", "NEBULA_PEER": "b", "NEBULA_PEER_ADDRESS": "b.example.org:7443"},
    "b": {"NEBULA_CLUSTER": "b", "NEBULA_PEER": "a"},
}
_VAR = re.compile(r"\$\{(?P<name>[A-Z_]+)(?:(?P<op>:-|:\?)(?P<arg>[^}]*))?\}")


def _interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error} (the forms the file uses)."""

    def value(match: re.Match[str]) -> str:
        name, op, arg = match["name"], match["op"], match["arg"]
        if env.get(name):
            return env[name]
        if op == ":?":
            raise ValueError(f"{name}: {arg}")
        return arg if op == ":-" else ""

    return _VAR.sub(value, text)


def _compose(org: str) -> dict[str, Any]:
    return yaml.safe_load(_interpolate(COMPOSE.read_text(), ORGS[org]))


def _settings(svc: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    cls, prefix = SETTINGS[svc["command"][0]]
    env = {k: str(v) for k, v in svc["environment"].items() if not k.startswith("NEBULA_HEALTH_")}
    fields = {name.upper() for name in cls.model_fields}
    unknown = [k for k in env if not k.startswith(prefix) or k.removeprefix(prefix) not in fields]
    assert not unknown, f"{svc['command'][0]}: not settings fields: {unknown}"
    with monkeypatch.context() as m:
        for key in list(__import__("os").environ):
            if key.startswith("NEBULA_"):
                m.delenv(key)
        for key, val in env.items():
            m.setenv(key, val)
        return cls()


def test_a_missing_cluster_or_peer_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match="NEBULA_CLUSTER"):
        _interpolate(COMPOSE.read_text(), {})
    with pytest.raises(ValueError, match="NEBULA_PEER"):
        _interpolate(COMPOSE.read_text(), {"NEBULA_CLUSTER": "a"})


@pytest.mark.parametrize("org", sorted(ORGS))
def test_each_organisation_runs_one_cluster_pointed_at_its_peer(
    org: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    compose = _compose(org)
    peer = ORGS[org]["NEBULA_PEER"]
    services = compose["services"]
    assert compose["name"] == f"nebula-{org}"
    assert set(services) == {*ONE_SHOT, "signer", "auth", "data", "codec", "switch", "trainer"}
    built = {name: _settings(svc, monkeypatch) for name, svc in services.items() if name not in ONE_SHOT}
    for settings in built.values():
        assert settings.cluster_id == org
    switch = built["switch"]
    assert switch.peer_cluster_id == peer
    assert switch.dials() == (org == "a")  # the id that sorts first dials
    assert (switch.peer_address is not None) == (org == "a")
    assert switch.own_crl is not None and switch.peer_crl is None  # the peer's CRL comes over the link
    sockets = built["signer"].socket_map()
    for name in ("auth", "data", "switch", "trainer"):  # each log sealed by the signer, on its own socket
        assert built[name].audit_signer == "unix:/var/lib/nebula/audit-signer/signer.sock"
        assert f"{name}-signer:/var/lib/nebula/audit-signer:ro" in services[name]["volumes"]
        assert f"{name}-signer:{sockets[name].parent}" in services["signer"]["volumes"]
    keys = [
        name for name, svc in services.items() if any(v.startswith("signer-keys:") for v in svc["volumes"])
    ]
    assert sorted(keys) == ["signer", "signer-init"], "only the signer (and its init) mount the seal keys"

    for name, svc in services.items():
        networks = set(svc.get("networks", []))
        assert ("wan" in networks) == (name == "switch"), f"{name} networks {networks}"
        for port in svc.get("ports", []):
            host = port.rsplit(":", 2)[0] if port.count(":") == 2 else ""
            published_wan = port.endswith(":7443")
            assert host == "127.0.0.1" or (name == "switch" and published_wan), f"{name} publishes {port}"
        mounts = [v.split(":")[0] for v in svc.get("volumes", [])]
        assert ("/pki" in [v.split(":")[1] for v in svc.get("volumes", [])]) == (name == "pki-export")
        if name != "pki-export":
            assert svc["user"] == "10001:10001" and svc["read_only"] is True and svc["cap_drop"] == ["ALL"]
            assert all(not m.startswith((".", "/")) for m in mounts), f"{name} bind-mounts the host"


def _load_pki_export() -> Any:
    spec = importlib.util.spec_from_file_location("pki_export", ROOT / "docker" / "pki_export.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pki_export_organisation_mode_exports_only_own_material(tmp_path: Path) -> None:
    pki_export = _load_pki_export()
    a, _ = init_cluster(tmp_path / "pki", "a")
    b, _ = init_cluster(tmp_path / "peer", "b")
    out = tmp_path / "out"
    (out / "switch").mkdir(parents=True)
    (out / "auth").mkdir()
    services = ("auth", "codec", "data", "switch", "trainer")
    for service in services:
        (out / f"{service}-a-internal-tls").mkdir()
    with pytest.raises(SystemExit, match="trusts no peer yet"):
        pki_export.main(["--pki", str(tmp_path / "pki"), "--out", str(out), "--organisation", "a"])
    add_trust(tmp_path / "pki", "a", "b", b.ca_cert.read_bytes())
    assert pki_export.main(["--pki", str(tmp_path / "pki"), "--out", str(out), "--organisation", "a"]) == 0
    exported = {p.name: p.read_bytes() for p in (out / "switch").iterdir()}
    assert exported == {
        "tls.crt": a.switch_cert.read_bytes(),
        "tls.key": a.switch_key.read_bytes(),
        "trust-bundle.pem": a.trust_bundle.read_bytes(),
        "crl.pem": a.crl.read_bytes(),
    }
    assert a.ca_key.read_bytes() not in b"".join(exported.values())
    for path in (out / "switch").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o400
    assert (out / "auth" / "admin-password").read_bytes().strip()
    for service in services:  # each service's internal identity, from a's CA, without its key
        internal = {p.name: p.read_bytes() for p in (out / f"{service}-a-internal-tls").iterdir()}
        assert set(internal) == {"ca.crt", "crl.pem", "service.crt", "service.key"}
        assert internal["ca.crt"] == a.ca_cert.read_bytes()
        assert internal["crl.pem"] == a.crl.read_bytes()
        assert a.ca_key.read_bytes() not in b"".join(internal.values())
