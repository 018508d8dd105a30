"""The endpoints file (one file for any deployment): read back what is written, refuse what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nebula_common.cli.compose import declared_ports
from nebula_common.errors import NebulaError
from nebula_common.sdk.deployment import DeploymentFileError, DeploymentTarget, write_endpoints_file
from nebula_common.sdk.job_logs import command_log_records


def endpoints(tmp_path: Path, **changes: object) -> Path:
    (tmp_path / "a-ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    body: dict = {
        "nebula_endpoints": 1,
        "clusters": {
            "a": {
                "auth": "127.0.0.1:17600",
                "trainer": "127.0.0.1:17500",
                "switch": "127.0.0.1:17400",
                "data": "127.0.0.1:17800",
                "ca_cert": "a-ca.crt",
                "admin_password_file": "a-admin-password",
                "metrics": {"switch-a": "http://127.0.0.1:19100/metrics"},
            }
        },
        "link": {"bandwidth_mbit": 60, "rtt_ms": 40},
        "logs": {"command": ["podman-compose", "logs", "--no-color"], "services": ["trainer-a"]},
    }
    body["clusters"]["a"].update(changes)
    path = tmp_path / "endpoints.json"
    path.write_text(json.dumps(body))
    return path


def test_an_endpoints_file_reads_back_as_written(tmp_path: Path) -> None:
    target = DeploymentTarget.load(endpoints(tmp_path))
    ep, admin = target.clusters["a"]
    assert (ep.auth, ep.trainer, ep.switch) == ("127.0.0.1:17600", "127.0.0.1:17500", "127.0.0.1:17400")
    assert ep.data == "127.0.0.1:17800"
    assert admin == tmp_path / "a-admin-password" and target.ca_certs["a"] == tmp_path / "a-ca.crt"
    assert target.link is not None and target.link.rtt_ms == 40
    assert target.logs["services"] == ["trainer-a"]
    assert target.stopped_records() is None  # not a local run: its trainers are asked
    # A directory holding only an endpoints file stands for it; a copy written elsewhere reads the same.
    assert DeploymentTarget.load(tmp_path).clusters["a"][0] == ep
    copy = write_endpoints_file(target, tmp_path / "copy" / "endpoints.json")
    again = DeploymentTarget.load(copy)
    assert again.clusters["a"] == (ep, tmp_path / "copy" / ".." / "a-admin-password")
    assert again.logs == target.logs and again.link == target.link


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"auth": "localhost"}, "clusters.a.auth: expected HOST:PORT"),
        ({"trainer": 17500}, "clusters.a.trainer: expected HOST:PORT"),
        ({"switch": "h:99999"}, "clusters.a.switch: expected HOST:PORT"),
        ({"ca_cert": ""}, "clusters.a.ca_cert: the cluster's CA certificate is required"),
        ({"ca_cert": "missing.crt"}, "clusters.a.ca_cert: no file"),
        ({"metrics": ["x"]}, "clusters.a.metrics must map names to URLs"),
        ({"admin_password_file": 3}, "admin_password_file must be a path"),
        ({"data": "nowhere"}, "clusters.a.data: expected HOST:PORT"),
    ],
)
def test_a_wrong_field_is_refused_by_name(tmp_path: Path, change: dict, message: str) -> None:
    with pytest.raises(DeploymentFileError, match=message.replace(".", r"\.")):
        DeploymentTarget.load(endpoints(tmp_path, **change))


def test_a_file_without_a_data_address_still_reads_and_writes_none(tmp_path: Path) -> None:
    """Endpoints files written before the data address was added stay valid (`data` is optional)."""
    path = endpoints(tmp_path)
    body = json.loads(path.read_text())
    del body["clusters"]["a"]["data"]
    path.write_text(json.dumps(body))
    target = DeploymentTarget.load(path)
    assert target.clusters["a"][0].data == ""
    copy = write_endpoints_file(target, tmp_path / "copy" / "endpoints.json")
    assert "data" not in json.loads(copy.read_text())["clusters"]["a"]


def test_a_file_without_an_admin_password_asks_for_credentials(tmp_path: Path) -> None:
    path = endpoints(tmp_path)
    body = json.loads(path.read_text())
    del body["clusters"]["a"]["admin_password_file"]
    path.write_text(json.dumps(body))
    with pytest.raises(DeploymentFileError, match="names no admin password file; pass credentials"):
        DeploymentTarget.load(path).admin_password("a")


@pytest.mark.parametrize(
    "body",
    [
        {"nebula_endpoints": 2, "clusters": {}},
        {"nebula_endpoints": 1, "clusters": []},
        {"nebula_endpoints": 1},
    ],
)
def test_a_wrong_format_or_no_clusters_is_refused(tmp_path: Path, body: dict) -> None:
    path = tmp_path / "endpoints.json"
    path.write_text(json.dumps(body))
    with pytest.raises(DeploymentFileError, match=str(path)):
        DeploymentTarget.load(path)


def test_the_kubernetes_port_forward_example_is_a_valid_endpoints_file(tmp_path: Path) -> None:
    """k8s/README.md's endpoints file, as documented (with its CA files present), reads as written."""
    readme = (Path(__file__).resolve().parents[2] / "k8s" / "README.md").read_text()
    block = readme.split('```json\n{"nebula_endpoints"', 1)[1].split("```", 1)[0]
    body = json.loads('{"nebula_endpoints"' + block)
    for cluster in ("a", "b"):
        ca = tmp_path / "pki" / cluster / "services" / "auth" / "ca.crt"
        ca.parent.mkdir(parents=True)
        ca.write_text("-----BEGIN CERTIFICATE-----\n")
        (tmp_path / "pki" / cluster / "services" / "monitoring").mkdir(parents=True)
    (tmp_path / "endpoints.json").write_text(json.dumps(body))
    target = DeploymentTarget.load(tmp_path / "endpoints.json")
    assert target.monitoring["a"] == tmp_path / "pki" / "a" / "services" / "monitoring"
    assert sorted(target.clusters) == ["a", "b"]
    assert target.clusters["b"][0].trainer == "127.0.0.1:27500"
    assert target.clusters["b"][0].data == "127.0.0.1:27800"  # `nebula account grants` needs it
    assert target.logs["command"][:3] == ["kubectl", "-n", "nebula"]


def test_compose_endpoints_read_the_published_ports_from_the_compose_file(tmp_path: Path) -> None:
    """docker-compose.yml's literal mappings; a mapping with a variable is left to the engine."""
    ports = declared_ports(Path(__file__).resolve().parents[2] / "docker-compose.yml")
    for cluster, base in (("a", 1), ("b", 2)):
        assert ports[(f"auth-{cluster}", 7600)] == f"127.0.0.1:{base}7600"
        assert ports[(f"trainer-{cluster}", 7500)] == f"127.0.0.1:{base}7500"
        assert ports[(f"switch-{cluster}", 7400)] == f"127.0.0.1:{base}7400"
        assert ports[(f"switch-{cluster}", 9100)] == f"127.0.0.1:{base}9100"
        assert ports[(f"data-{cluster}", 7800)] == f"127.0.0.1:{base}7800"
    odd = tmp_path / "compose.yml"
    odd.write_text('services:\n  auth-a:\n    ports: ["127.0.0.1:${P:-1}:7600", "7601"]\n  x: null\n')
    assert declared_ports(odd) == {}
    assert declared_ports(tmp_path / "missing.yml") == {}


def test_the_log_command_keeps_only_the_jobs_json_records_in_time_order() -> None:
    """`nebula job logs` on a compose/k8s deployment: COMMAND SERVICE per service, engine prefixes skipped."""
    lines = [
        'trainer-a | {"job_id": "j1", "ts": "2", "service": "trainer"}',
        '{"job_id": "j1", "ts": "1"}',
        '{"job_id": "j2", "ts": "0"}',
        "j1 is not JSON {",
    ]
    records = command_log_records({"command": ["printf", "%s\\n"], "services": lines}, "j1")
    assert [(r["ts"], r["source"]) for r in records] == [("1", lines[1]), ("2", lines[0])]
    with pytest.raises(NebulaError, match="`false trainer-a` exited 1"):
        command_log_records({"command": ["false"], "services": ["trainer-a"]}, "j1")
