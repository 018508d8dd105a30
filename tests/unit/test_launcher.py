"""The launcher reports a dead or misconfigured service clearly instead of hanging."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from nebula_common.launcher.local import LocalDeployment
from nebula_common.launcher.process import ServiceProcess, ServiceStartError, console_command

pytestmark = pytest.mark.timeout(60)


def test_a_service_that_dies_at_start_up_is_reported_with_its_log(tmp_path: Path) -> None:
    process = ServiceProcess(
        name="broken",
        command=[
            sys.executable,
            "-c",
            "import sys; print('boom: bad setting', file=sys.stderr); sys.exit(3)",
        ],
        env={},
        log_dir=tmp_path,
    )
    process.start()
    started = time.monotonic()
    with pytest.raises(ServiceStartError, match=r"broken exited with code 3[\s\S]*boom: bad setting"):
        process.wait_ready(timeout=30)
    assert time.monotonic() - started < 10


def test_ports_are_read_from_the_first_stdout_line(tmp_path: Path) -> None:
    script = "import json, time; print(json.dumps({'grpc_port': 1234}), flush=True); time.sleep(60)"
    process = ServiceProcess(name="svc", command=[sys.executable, "-c", script], env={}, log_dir=tmp_path)
    process.start()
    try:
        assert process.wait_ready(timeout=30) == {"grpc_port": 1234}
    finally:
        assert process.stop(timeout=5) is not None


@pytest.mark.parametrize(
    ("module", "missing"),
    [
        ("services.switch", "NEBULA_SWITCH_CLUSTER_ID: required but not set"),
        ("services.trainer", "NEBULA_TRAINER_SWITCH_ADDRESS: required but not set"),
        ("services.auth", "NEBULA_AUTH_CLUSTER_ID: required but not set"),
        ("services.codec", "NEBULA_CODEC_AUTH_ADDRESS: required but not set"),
        ("services.data", "NEBULA_DATA_CLUSTER_ID: required but not set"),
    ],
)
def test_services_refuse_to_start_without_required_settings(module: str, missing: str) -> None:
    env = {"PATH": "/usr/bin:/bin", "NEBULA_TRAINER_CLUSTER_ID": "a"}
    result = subprocess.run(console_command(module), env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert missing in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("module", "env", "named"),
    [
        ("services.codec", {"NEBULA_CODEC_CLUSTER_ID": "A b"}, "NEBULA_CODEC_CLUSTER_ID"),
        (
            "services.codec",
            {"NEBULA_CODEC_CLUSTER_ID": "a", "NEBULA_CODEC_AUTH_ADDRESS": "nohost"},
            "AUTH_ADDRESS",
        ),
        (
            "services.data",
            {"NEBULA_DATA_CLUSTER_ID": "a", "NEBULA_DATA_LOG_LEVEL": "LOUD"},
            "NEBULA_DATA_LOG_LEVEL",
        ),
    ],
)
def test_services_name_the_bad_setting(module: str, env: dict[str, str], named: str) -> None:
    result = subprocess.run(
        console_command(module),
        env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert named in result.stderr and "Traceback" not in result.stderr


def test_a_relative_run_directory_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Services start in their box's /tmp and stages in their account's directory: a relative
    ``--run-dir runs/demo`` would point each elsewhere (the stage's checkpoints once nested there)."""
    monkeypatch.chdir(tmp_path)
    deployment = LocalDeployment(Path("runs/demo"))
    assert deployment.run_dir == tmp_path / "runs" / "demo"
    launcher = deployment.launcher
    assert launcher.run_dir.is_absolute() and launcher.log_dir.is_absolute()
    assert launcher.pki_dir is not None and launcher.pki_dir.is_absolute()
