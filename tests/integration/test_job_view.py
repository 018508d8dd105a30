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
from nebula_common.cli.job import console, interrupted
from nebula_common.jobspec.builtin import builtin_spec
from nebula_common.launcher import LocalDeployment
from nebula_common.sdk.client import ClusterSession
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


def flat(text: str) -> str:
    """Rich wraps console text at the terminal's width (80 here): compare messages with one space."""
    return " ".join(text.split())


def nebula_stdout(*args: str) -> str:
    """A command's standard output alone (a stray log line on stderr must not break its JSON)."""
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def nebula_json(*args: str) -> Any:
    return json.loads(nebula_stdout(*args, "--json"))


def sessions_from(deployment: LocalDeployment, credentials: Path) -> dict[str, ClusterSession]:
    entries = yaml.safe_load(credentials.read_text())
    return {
        cluster: ClusterSession.login(deployment.endpoints(cluster), entry["username"], entry["password"])
        for cluster, entry in entries.items()
    }


@pytest.mark.long  # two jobs, one after the other (`make test-faults`)
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
            "--new-account",
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
    dep = ("--deployment", str(deployment_file))
    # Submitted detached (it runs until cancelled): the command returns once both stages are assigned.
    submitted = tmp_path / "submitted.json"
    code, output = nebula(
        "job", "submit", str(builtin_spec("numbers")), *dep, "--credentials", str(owner),
        "--set", "steps=10000", "--set", "checkpoint.interval=0", "--detach", "--json", str(submitted),
    )  # fmt: skip
    assert code == 0 and "nebula job watch" in flat(output) and "nebula job cancel" in flat(output), output
    # Each trainer says where it runs its stage: in a box, as for every account's code.
    assert "stage encoder on a:" in flat(output) and "stage decoder on b:" in flat(output), output
    assert flat(output).count("box on this trainer") == 2, output
    job_id = json.loads(submitted.read_text())["job_id"]
    same_spec = numbers_job(steps=10_000, checkpoint__interval=0)  # same spec, modules and codecs, other id

    mine = nebula_json("job", "list", *dep, "--credentials", str(owner))
    assert [j["job_id"] for j in mine] == [job_id]
    record = mine[0]
    assert record["owners"] == {"a": sessions["a"].username, "b": sessions["b"].username}
    assert record["clusters"] == {"encoder": "a", "decoder": "b"}
    assert record["spec_digest"] == same_spec.spec_digest and len(record["spec_digest"]) == 64
    assert record["started_unix"] > 0 and record["ended_unix"] is None

    # Ctrl-C while following, without a terminal (as here): the job is left running, with how to re-attach.
    with console.capture() as captured:
        interrupted(job_id, sessions, deployment_file)
    assert "left running" in flat(captured.get()) and f"nebula job watch {job_id}" in flat(captured.get())
    still = nebula_json("job", "status", job_id, *dep, "--credentials", str(owner))
    assert still["state"] in ("PENDING", "RUNNING"), still

    # Another account neither lists, sees nor cancels it; an admin (no --credentials) sees every job.
    assert job_id not in [
        j["job_id"] for j in nebula_json("job", "list", *dep, "--credentials", str(stranger))
    ]
    code, output = nebula("job", "status", job_id, *dep, "--credentials", str(stranger))
    assert code == 1 and f"no job '{job_id}' visible" in flat(output), output
    code, output = nebula("job", "cancel", job_id, *dep, "--credentials", str(stranger))
    assert code == 1 and "no job" in flat(output), output
    assert job_id in [j["job_id"] for j in nebula_json("job", "list", *dep)]
    status = nebula_json("job", "status", job_id, *dep, "--credentials", str(owner))
    assert status["state"] in ("PENDING", "RUNNING"), status

    # The owner cancels: both stages stop, and both say CANCELLED (one hears it from its peer first).
    cancelled = nebula_json("job", "cancel", job_id, *dep, "--credentials", str(owner))
    assert cancelled["state"] == "CANCELLED", cancelled
    assert {s["stage"]: s["state"] for s in cancelled["stages"]} == {
        "encoder": "CANCELLED",
        "decoder": "CANCELLED",
    }
    assert {s["message"] for s in cancelled["stages"]} <= {"cancelled", PEER_CANCELLED}
    assert cancelled["ended_unix"] >= cancelled["started_unix"]

    # watch of an ended job replays its statuses and ends with the final record.
    output = nebula_stdout("job", "watch", job_id, *dep, "--credentials", str(owner), "--json")
    lines = [json.loads(line) for line in output.splitlines()]
    assert lines[-1]["final"]["state"] == "CANCELLED"
    assert {line["stage"] for line in lines[:-1]} == {"encoder", "decoder"}

    logs = nebula_json("job", "logs", job_id, *dep, "--credentials", str(owner))
    assert {r["job_id"] for r in logs} == {job_id}
    assert any(r["message"] == "stage assigned" for r in logs), logs
    assert {r["source"] for r in logs} >= {"trainer-a", "trainer-b"}, logs  # each names its process
    text = nebula_stdout("job", "logs", job_id, *dep, "--credentials", str(owner))
    assert " trainer-a " in text and " trainer-b " in text, text
    code, output = nebula("job", "logs", job_id, *dep, "--credentials", str(stranger))
    assert code == 1 and "no job" in flat(output), output
    for session in sessions.values():
        session.close()
