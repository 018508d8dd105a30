"""`nebula account --deployment`: any deployment file `nebula job` takes, and what is missing named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nebula_common.cli.account_targets import AccountCommandError, load_deployment
from nebula_common.cli.app import app


def endpoints_file(folder: Path, **changes: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a-ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    entry: dict = {
        "auth": "127.0.0.1:17600",
        "trainer": "127.0.0.1:17500",
        "switch": "127.0.0.1:17400",
        "data": "127.0.0.1:17800",
        "ca_cert": "a-ca.crt",
        "admin_password_file": "a-admin-password",
    }
    entry.update(changes)
    entry = {k: v for k, v in entry.items() if v is not None}
    path = folder / "endpoints.json"
    path.write_text(json.dumps({"nebula_endpoints": 1, "clusters": {"a": entry}}))
    return path


def test_an_endpoints_file_or_its_folder_gives_the_clusters_and_keeps_credentials_beside_it(
    tmp_path: Path,
) -> None:
    path = endpoints_file(tmp_path / "compose")
    for given in (path, path.parent):
        deployment = load_deployment(None, given)
        (target,) = deployment.select([])
        assert (target.cluster, target.auth, target.data_address()) == (
            "a",
            "127.0.0.1:17600",
            "127.0.0.1:17800",
        )
        assert target.admin_password_file == tmp_path / "compose" / "a-admin-password"
        assert deployment.run_dir == tmp_path / "compose"  # credentials/<name>.yaml go here


def test_an_older_file_without_the_data_address_names_the_key_and_the_command_that_writes_it(
    tmp_path: Path,
) -> None:
    path = endpoints_file(tmp_path, data=None)
    (target,) = load_deployment(None, path).select([])
    with pytest.raises(AccountCommandError) as missing:
        target.data_address()
    message = str(missing.value)
    assert f"{path}: clusters.a.data is missing" in message
    assert "`nebula compose endpoints`" in message and "`nebula local up`" in message


def test_a_file_without_an_admin_password_file_says_how_to_act_instead(tmp_path: Path) -> None:
    path = endpoints_file(tmp_path, admin_password_file=None)
    result = CliRunner().invoke(app, ["account", "list", "--deployment", str(path)])
    assert result.exit_code == 2, result.output
    assert f"{path}: clusters.a names no admin_password_file" in " ".join(result.stderr.split())
    assert "--as NAME" in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize(
    ("change", "named"),
    [({"auth": "nowhere"}, "clusters.a.auth: expected HOST:PORT"), ({"data": 7800}, "clusters.a.data")],
)
def test_a_bad_address_is_named_with_no_traceback(tmp_path: Path, change: dict, named: str) -> None:
    path = endpoints_file(tmp_path, **change)
    result = CliRunner().invoke(app, ["account", "grants", "alice", "--deployment", str(path)])
    assert result.exit_code == 2 and named in result.stderr, result.output
    assert "Traceback" not in result.output


def test_exactly_one_of_run_dir_and_deployment(tmp_path: Path) -> None:
    path = endpoints_file(tmp_path)
    for run_dir, deployment in ((None, None), (tmp_path, path)):
        with pytest.raises(AccountCommandError, match="exactly one of --run-dir DIR or --deployment"):
            load_deployment(run_dir, deployment)
