"""`nebula account` against a live two-cluster deployment, in-process: admins manage, others are refused."""

from __future__ import annotations

import json
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from nebula_common.cli.app import app
from nebula_common.cli.job import keep_created, sessions_for
from nebula_common.clients.auth import AuthClient
from nebula_common.clients.data import DataClient
from nebula_common.errors import AuthenticationError
from nebula_common.launcher import LocalDeployment
from nebula_common.sdk.client import ClusterSession
from nebula_common.sdk.deployment import DeploymentTarget, write_endpoints_file

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.fixture
def described(deployment: LocalDeployment, tmp_path: Path) -> Path:
    """A deployment.json of the shared deployment in a folder of this test's own (credentials go there)."""
    path = tmp_path / "deployment.json"
    deployment.write_description(path)
    return path


@pytest.fixture
def n() -> Callable[[str], str]:
    """Account and dataset names unique to this test run: the deployment is shared and may be reused."""
    suffix = secrets.token_hex(3)
    return lambda name: f"{name}-{suffix}"


def account(described: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    result = CliRunner().invoke(app, ["account", *args, "--deployment", str(described)], env=env)
    return result


def ok_json(result: Any) -> Any:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def can_login(deployment: LocalDeployment, cluster: str, username: str, password: str) -> bool:
    with AuthClient(deployment.endpoints(cluster).auth) as auth:
        try:
            auth.login(username, password)
        except AuthenticationError:
            return False
    return True


def test_create_shows_the_password_once_stores_it_0600_and_never_overwrites(
    deployment: LocalDeployment, described: Path, n: Callable[[str], str]
) -> None:
    created = ok_json(account(described, "create", n("acct-carol"), "--json"))
    stored = Path(created["credentials_file"])
    assert stored == described.parent / "credentials" / f"{n('acct-carol')}.yaml"
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    assert stat.S_IMODE(stored.parent.stat().st_mode) == 0o700
    on_disk = yaml.safe_load(stored.read_text())
    for cluster in ("a", "b"):
        password = created["accounts"][cluster]["password"]
        assert on_disk[cluster] == {"username": n("acct-carol"), "password": password}
        assert can_login(deployment, cluster, n("acct-carol"), password)
    assert created["accounts"]["a"]["password"] != created["accounts"]["b"]["password"]

    text = account(described, "create", n("acct-carol"), "--cluster", "a")
    assert text.exit_code == 2 and "already exist" in text.stderr, text.output
    assert yaml.safe_load(stored.read_text()) == on_disk  # untouched

    listed = ok_json(account(described, "list", "--json"))
    rows = {(row["cluster_id"], row["username"]): row for row in listed}
    assert rows[("a", n("acct-carol"))]["role"] == "user" and not rows[("b", n("acct-carol"))]["disabled"]
    assert ("a", "admin") in rows


def test_only_admins_manage_accounts(
    deployment: LocalDeployment, described: Path, n: Callable[[str], str]
) -> None:
    ok_json(account(described, "create", n("acct-dave"), "--cluster", "a", "--json"))
    refused = account(described, "create", n("acct-mallory"), "--cluster", "a", "--as", n("acct-dave"))
    assert refused.exit_code == 1, refused.output
    assert (
        f"cluster a: creating account {n('acct-mallory')!r} refused: only an admin of the cluster may"
        in refused.stderr
    )
    assert "Traceback" not in refused.output
    assert not (described.parent / "credentials" / f"{n('acct-mallory')}.yaml").exists()
    for args in (["list"], ["disable", "admin"]):
        result = account(described, *args, "--cluster", "a", "--as", n("acct-dave"))
        assert result.exit_code == 1 and "only an admin" in result.stderr, (args, result.output)
    # Another account's password: the auth service does not even confirm that it exists.
    result = account(described, "passwd", "admin", "--cluster", "a", "--as", n("acct-dave"))
    assert result.exit_code == 1 and "no account 'admin'" in result.stderr, result.output
    admin_password = Path(json.loads(described.read_text())["clusters"]["a"]["admin_password_file"])
    assert can_login(deployment, "a", "admin", admin_password.read_text().strip())
    # Its own password a user may change (the current one comes from its credentials file).
    own = ok_json(
        account(described, "passwd", n("acct-dave"), "--cluster", "a", "--as", n("acct-dave"), "--json")
    )
    assert can_login(deployment, "a", n("acct-dave"), own["passwords"]["a"])
    listed = ok_json(account(described, "list", "--cluster", "a", "--json"))
    assert n("acct-mallory") not in {row["username"] for row in listed}


def test_passwd_rotates_and_disable_stops_logins(
    deployment: LocalDeployment, described: Path, n: Callable[[str], str]
) -> None:
    first = ok_json(account(described, "create", n("acct-erin"), "--json"))["accounts"]
    rotated = ok_json(account(described, "passwd", n("acct-erin"), "--cluster", "b", "--json"))
    new = rotated["passwords"]["b"]
    assert new != first["b"]["password"]
    assert not can_login(deployment, "b", n("acct-erin"), first["b"]["password"])
    assert can_login(deployment, "b", n("acct-erin"), new)
    on_disk = yaml.safe_load(Path(rotated["credentials_file"]).read_text())
    assert on_disk["b"]["password"] == new and on_disk["a"]["password"] == first["a"]["password"]

    disabled = ok_json(account(described, "disable", n("acct-erin"), "--cluster", "a", "--json"))
    assert disabled[0]["disabled"] is True
    assert not can_login(deployment, "a", n("acct-erin"), first["a"]["password"])
    ok_json(account(described, "disable", n("acct-erin"), "--cluster", "a", "--enable", "--json"))
    assert can_login(deployment, "a", n("acct-erin"), first["a"]["password"])


def test_grants_show_role_and_dataset_grants_both_ways(
    deployment: LocalDeployment, described: Path, sessions: dict[str, ClusterSession], n: Callable[[str], str]
) -> None:
    ok_json(account(described, "create", n("acct-frank"), "--cluster", "a", "--json"))
    owner = sessions["a"]
    with DataClient(deployment.data_address("a"), owner.token) as data:
        data.upload_records(n("shared"), [{"x": 1}, {"x": 2}])
        data.grant(n("shared"), n("acct-frank"))
    shown = ok_json(account(described, "grants", n("acct-frank"), "--cluster", "a", "--json"))
    (row,) = shown
    assert row["account"]["role"] == "user"
    assert any("submit jobs" in right for right in row["may"])
    assert row["datasets"] == {"granted_to_it": [f"{owner.username}/{n('shared')}"], "its_datasets": {}}
    admin = ok_json(account(described, "grants", "admin", "--cluster", "a", "--json"))
    assert admin[0]["account"]["role"] == "admin" and admin[0]["datasets"] is None


def test_an_endpoints_file_targets_the_deployment_as_for_nebula_job(
    deployment: LocalDeployment,
    described: Path,
    sessions: dict[str, ClusterSession],
    n: Callable[[str], str],
    tmp_path: Path,
) -> None:
    """The one file for any deployment (what `local up` and `nebula compose endpoints` write)."""
    ep = write_endpoints_file(DeploymentTarget.load(described), tmp_path / "ep" / "endpoints.json")
    created = ok_json(account(ep.parent, "create", n("acct-gina"), "--cluster", "a", "--json"))
    assert Path(created["credentials_file"]) == ep.parent / "credentials" / f"{n('acct-gina')}.yaml"
    assert can_login(deployment, "a", n("acct-gina"), created["accounts"]["a"]["password"])
    listed = ok_json(account(ep, "list", "--cluster", "a", "--json"))
    assert n("acct-gina") in {row["username"] for row in listed}
    owner = sessions["a"]
    with DataClient(deployment.data_address("a"), owner.token) as data:
        data.upload_records(n("shared-ep"), [{"x": 1}])
        data.grant(n("shared-ep"), n("acct-gina"))
    (row,) = ok_json(account(ep, "grants", n("acct-gina"), "--cluster", "a", "--json"))
    assert row["datasets"] == {"granted_to_it": [f"{owner.username}/{n('shared-ep')}"], "its_datasets": {}}
    # A file written before the data address was added: grants name the key and what writes it.
    body = json.loads(ep.read_text())
    del body["clusters"]["a"]["data"]
    ep.write_text(json.dumps(body))
    old = account(ep, "grants", n("acct-gina"), "--cluster", "a")
    assert old.exit_code == 2 and f"{ep}: clusters.a.data is missing" in old.stderr, old.output
    assert "nebula compose endpoints" in old.stderr and "Traceback" not in old.output
    assert ok_json(account(ep, "list", "--cluster", "a", "--json"))  # everything else still works


def test_a_bad_deployment_file_is_named(tmp_path: Path) -> None:
    missing = account(tmp_path / "nope.json", "list")
    assert missing.exit_code == 2, missing.output
    assert f"cannot read deployment description {tmp_path / 'nope.json'}" in missing.stderr
    broken = tmp_path / "broken.json"
    broken.write_text('{"clusters": {"a": {}}}')
    result = account(broken, "list")
    assert result.exit_code == 2 and "deployment description is missing" in result.stderr, result.output


def test_exactly_one_target_is_required(tmp_path: Path) -> None:
    runner = CliRunner()
    neither = runner.invoke(app, ["account", "list"])
    both = runner.invoke(app, ["account", "list", "--run-dir", str(tmp_path), "--deployment", "x.json"])
    for result in (neither, both):
        assert result.exit_code == 2 and "exactly one of --run-dir DIR or --deployment" in result.stderr
    via_run_dir = runner.invoke(app, ["account", "list", "--run-dir", str(tmp_path)])
    assert via_run_dir.exit_code == 2, via_run_dir.output
    assert f"cannot read deployment description {tmp_path / 'deployment.json'}" in via_run_dir.stderr


def test_job_submit_keeps_the_accounts_it_creates_0600_and_prints_the_path_once(
    deployment: LocalDeployment, described: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`nebula job submit` without --credentials: its new accounts' passwords are stored, not lost."""
    sessions = sessions_for(described, None, {"a", "b"})
    try:
        users = {cluster: session.username for cluster, session in sessions.items()}
    finally:
        for session in sessions.values():
            session.close()
    assert len(set(users.values())) == 1, users  # one name in both clusters: one credentials file
    username = users["a"]
    stored = described.parent / "credentials" / f"{username}.yaml"
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    on_disk = yaml.safe_load(stored.read_text())
    assert set(on_disk) == {"a", "b"}
    for cluster in ("a", "b"):
        assert on_disk[cluster]["username"] == username
        assert can_login(deployment, cluster, username, on_disk[cluster]["password"])
    out = capsys.readouterr()
    assert out.out.count(str(stored)) == 2, out.out  # "stored in PATH ... --credentials PATH", one line
    assert on_disk["a"]["password"] not in out.out + out.err  # the file holds it, the terminal does not

    again = sessions_for(described, stored, {"a", "b"})  # the stored file logs in as the same account
    try:
        assert {c: s.username for c, s in again.items()} == users
    finally:
        for session in again.values():
            session.close()
    assert sorted(p.name for p in stored.parent.iterdir()) == [stored.name]  # no new account made

    before = stored.read_bytes()  # an existing file is never overwritten; the passwords are shown instead
    created = {c: {"username": username, "password": f"other-{c}-password"} for c in ("a", "b")}
    assert keep_created(described.parent, created) is None
    assert stored.read_bytes() == before
    assert "password (shown once): other-a-password" in capsys.readouterr().err
