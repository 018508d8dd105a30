"""Jobs as objects on the shared real deployment: per-job accounting, list/status/watch/logs/cancel, owners.

The CLI runs in this process (Typer's runner, argv in, output captured): a subprocess would cost
~5 s of torch import per call, and these commands are plain functions over real gRPC.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from nebula_common.cli.app import app
from nebula_common.jobspec.builtin import builtin_spec
from nebula_common.launcher import LocalDeployment
from nebula_common.sdk.client import ClusterSession, submit_job
from services.trainer.runtime.lifecycle import PEER_CANCELLED
from tests.support.accounts import create_account
from tests.support.jobs import numbers_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
runner = CliRunner()


@pytest.fixture(scope="module")
def deployment_file(deployment: LocalDeployment, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("job-view") / "deployment.json"
    deployment.write_description(path)
    return path


def credentials_of(deployment: LocalDeployment, directory: Path, name: str) -> Path:
    """A fresh account of the same name in both clusters, as a --credentials file."""
    body = {c: {"username": name, "password": create_account(deployment, c, name)} for c in ("a", "b")}
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def nebula(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.output


def nebula_json(*args: str) -> Any:
    code, output = nebula(*args, "--json")
    assert code == 0, output
    return json.loads(output)


def sessions_from(deployment: LocalDeployment, credentials: Path) -> dict[str, ClusterSession]:
    entries = yaml.safe_load(credentials.read_text())
    return {
        cluster: ClusterSession.login(deployment.endpoints(cluster), entry["username"], entry["password"])
        for cluster, entry in entries.items()
    }


def test_two_jobs_back_to_back_each_report_their_own_codec_ratio(
    deployment_file: Path, tmp_path: Path
) -> None:
    """The second job's summary counts only its own bytes (the lifetime counters showed x1.33 for int8)."""
    ratios = {}
    for codec in ("fp16", "int8"):
        summary_path = tmp_path / f"{codec}.json"
        code, output = nebula(
            "job",
            "submit",
            str(builtin_spec("numbers")),
            "--deployment",
            str(deployment_file),
            "--set",
            "steps=3",
            "--set",
            f"edges.0.codec.forward={codec}",
            "--set",
            f"edges.0.codec.backward={codec}",
            "--json",
            str(summary_path),
        )
        assert code == 0, output
        wan = json.loads(summary_path.read_text())["wan"]
        for direction in ("forward", "backward"):
            entry = wan[direction]
            assert entry["counted_by"] == "switches"
            assert entry["bytes"] == entry["bytes_received_by_peer"] > entry["payload_bytes"] > 0
            assert entry["frames"] > 0
        ratios[codec] = (wan["forward"]["compression_ratio"], wan["backward"]["compression_ratio"])
    assert ratios["fp16"] == (pytest.approx(2.0, rel=0.02), pytest.approx(2.0, rel=0.02))
    assert ratios["int8"] == (pytest.approx(4.0, rel=0.02), pytest.approx(4.0, rel=0.02))


def test_list_status_cancel_logs_watch_and_only_owners_and_admins_see_a_job(
    deployment: LocalDeployment,
    deployment_file: Path,
    tmp_path: Path,
) -> None:
    owner = credentials_of(deployment, tmp_path, f"owner-{secrets.token_hex(2)}")
    stranger = credentials_of(deployment, tmp_path, f"stranger-{secrets.token_hex(2)}")
    sessions = sessions_from(deployment, owner)
    job = numbers_job(steps=10_000, checkpoint__interval=0)  # runs until cancelled
    submit_job(job, sessions)
    dep = ("--deployment", str(deployment_file))

    mine = nebula_json("job", "list", *dep, "--credentials", str(owner))
    assert [j["job_id"] for j in mine] == [job.job_id]
    record = mine[0]
    assert record["owners"] == {"a": sessions["a"].username, "b": sessions["b"].username}
    assert record["clusters"] == {"encoder": "a", "decoder": "b"}
    assert record["spec_digest"] == job.spec_digest and len(job.spec_digest) == 64
    assert record["started_unix"] > 0 and record["ended_unix"] is None

    # Another account neither lists, sees nor cancels it; an admin (no --credentials) sees every job.
    assert job.job_id not in [
        j["job_id"] for j in nebula_json("job", "list", *dep, "--credentials", str(stranger))
    ]
    code, output = nebula("job", "status", job.job_id, *dep, "--credentials", str(stranger))
    assert code == 1 and f"no job '{job.job_id}' visible" in output, output
    code, output = nebula("job", "cancel", job.job_id, *dep, "--credentials", str(stranger))
    assert code == 1 and "no job" in output, output
    assert job.job_id in [j["job_id"] for j in nebula_json("job", "list", *dep)]
    status = nebula_json("job", "status", job.job_id, *dep, "--credentials", str(owner))
    assert status["state"] in ("PENDING", "RUNNING"), status

    # The owner cancels: both stages stop, and both say CANCELLED (one hears it from its peer first).
    cancelled = nebula_json("job", "cancel", job.job_id, *dep, "--credentials", str(owner))
    assert cancelled["state"] == "CANCELLED", cancelled
    assert {s["stage"]: s["state"] for s in cancelled["stages"]} == {
        "encoder": "CANCELLED",
        "decoder": "CANCELLED",
    }
    assert {s["message"] for s in cancelled["stages"]} <= {"cancelled", PEER_CANCELLED}
    assert cancelled["ended_unix"] >= cancelled["started_unix"]

    # watch of an ended job replays its statuses and ends with the final record.
    code, output = nebula("job", "watch", job.job_id, *dep, "--credentials", str(owner), "--json")
    assert code == 0, output
    lines = [json.loads(line) for line in output.splitlines()]
    assert lines[-1]["final"]["state"] == "CANCELLED"
    assert {line["stage"] for line in lines[:-1]} == {"encoder", "decoder"}

    logs = nebula_json("job", "logs", job.job_id, *dep, "--credentials", str(owner))
    assert {r["job_id"] for r in logs} == {job.job_id}
    assert any(r["message"] == "stage assigned" for r in logs), logs
    code, output = nebula("job", "logs", job.job_id, *dep, "--credentials", str(stranger))
    assert code == 1 and "no job" in output
    for session in sessions.values():
        session.close()
