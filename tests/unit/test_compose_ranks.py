"""docker-compose.ranks.yml: cluster a's stage on two rank containers, as compose renders it.

The override is merged by the compose tool itself (``podman-compose ... config``, skipped when it is
not installed), and the rendered wiring is checked against the code that reads it: each rank's
variables parse as the worker's settings, the trainer's as its own, the ranks' world size, ranks
and rendezvous agree, the ranks share trainer-a's data volume and never touch the WAN network.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.trainer.config import TrainerSettings
from services.trainer.worker import settings as worker_settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict[str, Any]]:
    tool = shutil.which("podman-compose") or shutil.which("docker-compose")
    if tool is None:
        pytest.skip("neither podman-compose nor docker-compose is installed: cannot render the override")
    result = subprocess.run(
        [tool, "-f", "docker-compose.yml", "-f", "docker-compose.ranks.yml", "config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def test_cluster_a_gets_two_rank_containers_wired_to_its_trainer(
    rendered: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    ranks = {name: svc for name, svc in rendered.items() if name.startswith("trainer-a-rank-")}
    trainer = rendered["trainer-a"]
    trainer_env = _env(trainer)
    assert len(ranks) == int(trainer_env["NEBULA_TRAINER_RANKS"]) == 2
    # Every account's stage computes on the ranks (its driver boxed in trainer-a) unless the operator
    # names fewer.
    assert trainer_env["NEBULA_TRAINER_RANKS_ACCOUNTS"] == os.environ.get("NEBULA_RANKS_ACCOUNTS", "*")
    listen_port = int(trainer_env["NEBULA_TRAINER_RANKS_LISTEN"].rsplit(":", 1)[1])
    data_mount = next(
        v for v in trainer["volumes"] if v.endswith(":" + trainer_env["NEBULA_TRAINER_DATA_DIR"])
    )
    seen = set()
    for name, service in sorted(ranks.items()):
        env = _env(service)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        parsed = worker_settings()
        seen.add(parsed["rank"])
        assert parsed["world"] == len(ranks), name
        assert (parsed["trainer_host"], parsed["trainer_port"]) == ("trainer-a", listen_port), name
        assert str(parsed["data_dir"]) == trainer_env["NEBULA_TRAINER_DATA_DIR"], name
        assert env["MASTER_ADDR"] in ranks, f"{name}: rendezvous at a rank container"
        assert data_mount in service["volumes"], f"{name}: the ranks write checkpoints on trainer-a's volume"
        assert service["networks"] == ["cluster_a"], f"{name}: ranks stay inside cluster a"
        assert service["command"] == ["python", "-m", "services.trainer.worker"]
        # The rank store answers only the cluster's workers: each rank holds the worker identity.
        assert f"worker-a-internal-tls:{parsed['tls_dir']}:ro" in service["volumes"], name
        assert (
            service["read_only"] is True
            and service["cap_drop"] == ["ALL"]
            and service["user"] == "10001:10001"
        )
        assert service["restart"] == "unless-stopped", f"{name}: a rank that died must come back"
        assert service["depends_on"]["trainer-a"]["condition"] == "service_healthy"
    assert seen == set(range(len(ranks)))
    assert "worker-a-internal-tls:/export/worker-a-internal-tls" in rendered["pki-init"]["volumes"]
    assert not any("worker-a-internal-tls" in v for v in trainer["volumes"])  # the trainer has its own
    for key, value in trainer_env.items():
        monkeypatch.setenv(key, value)
    settings = TrainerSettings()
    assert settings.ranks == len(ranks)
    # The stages trainer-a runs itself (accounts not on the ranks) carry their edges as records on
    # switch-a's edge socket; the ranks' stages use gRPC through trainer-a: no rank reaches the socket.
    assert settings.switch_edge_socket == _env(rendered["switch-a"])["NEBULA_SWITCH_EDGE_SOCKET"]
    assert f"switch-a-edges:{Path(settings.switch_edge_socket).parent}:ro" in trainer["volumes"]
    for name, service in ranks.items():
        assert not any(v.startswith("switch-a-edges:") for v in service["volumes"]), name
        assert not any("EDGE_SOCKET" in key for key in _env(service)), name
    # Cluster b is untouched: its trainer runs its stages itself.
    assert "NEBULA_TRAINER_RANKS" not in _env(rendered["trainer-b"])
