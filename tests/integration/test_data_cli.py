"""`nebula data` as an owner and a grantee use it, against a real cluster's data and auth services."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from nebula_common.launcher import LocalDeployment
from tests.support.accounts import create_account

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def nebula_data(deployment: LocalDeployment, user: str, password: str, *args: str) -> CliResult:
    """``nebula data ARGS`` as a user runs it, in this process (a subprocess per call re-imports torch:
    eight of them outran the test's deadline on a busy machine). Bare addresses: the cluster CA that
    verifies them comes from NEBULA_CA_CERT, as for a user's shell."""
    from typer.testing import CliRunner

    from nebula_common.cli.app import app

    endpoints = [
        "--address",
        deployment.data_address("a"),
        "--auth",
        deployment.endpoints("a").auth,
        "--user",
        user,
    ]
    result = CliRunner().invoke(
        app,
        ["data", *args, *endpoints],
        env={"NEBULA_PASSWORD": password, "NEBULA_CA_CERT": str(deployment.ca_cert("a"))},
    )
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"nebula data {' '.join(args)} raised") from result.exception
    return CliResult(result.exit_code, result.stdout, result.stderr)


def test_owner_grants_a_grantee_who_reads_batches_until_revoked(
    deployment: LocalDeployment, tmp_path: Path
) -> None:
    owner_pw, reader_pw = create_account(deployment, "a", "olga"), create_account(deployment, "a", "rita")
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps({"id": i, "text": f"row {i}"}) + "\n" for i in range(5)))

    uploaded = nebula_data(deployment, "olga", owner_pw, "upload", "rows", str(source))
    assert uploaded.returncode == 0, uploaded.stderr
    assert "olga/rows: 5 records" in uploaded.stdout

    refused = nebula_data(deployment, "rita", reader_pw, "read", "olga/rows", "0,3")
    assert refused.returncode == 1
    assert "error:" in refused.stderr and "olga/rows" in refused.stderr  # named, not a traceback
    assert "Traceback" not in refused.stderr

    assert nebula_data(deployment, "olga", owner_pw, "grant", "rows", "rita").returncode == 0
    read = nebula_data(deployment, "rita", reader_pw, "read", "olga/rows", "0,3")
    assert read.returncode == 0, read.stderr
    assert [json.loads(line)["id"] for line in read.stdout.splitlines()] == [0, 3]

    # A grant allows batch reads only: the grantee cannot download the file.
    download = nebula_data(deployment, "rita", reader_pw, "download", "olga/rows", str(tmp_path / "x.jsonl"))
    assert download.returncode == 1 and not (tmp_path / "x.jsonl").exists()

    revoked = nebula_data(deployment, "olga", owner_pw, "revoke", "rows", "rita")
    assert revoked.returncode == 0 and "revoked rita" in revoked.stdout
    assert nebula_data(deployment, "rita", reader_pw, "read", "olga/rows", "0").returncode == 1

    bad_ids = nebula_data(deployment, "olga", owner_pw, "read", "rows", "1,x")
    assert bad_ids.returncode == 1 and "comma-separated" in bad_ids.stderr
