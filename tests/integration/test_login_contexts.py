"""Who the CLI acts as, once: `nebula login` keeps an identity per deployment (``sdk/contexts.py``).

On the shared two-cluster deployment, as a new user would: log in once with the credentials file an
admin handed out, then submit three jobs and list them with neither ``--deployment`` nor
``--credentials``: no account is created, the jobs are the user's own. A wrong password keeps nothing;
after ``logout`` a submit without an identity is refused naming `nebula login`; a damaged contexts
file is named, never a traceback.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from nebula_common.cli.app import app
from nebula_common.jobspec.builtin import builtin_spec
from nebula_common.launcher import LocalDeployment
from nebula_common.sdk.auth_client import AuthClient
from tests.support.accounts import admin_token, create_account

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def nebula(*args: str, stdin: str | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args), input=stdin)
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.stdout, result.output  # output: stdout and stderr together


def accounts(deployment: LocalDeployment) -> dict[str, int]:
    counts = {}
    for cluster in ("a", "b"):
        with AuthClient(deployment.endpoints(cluster).auth) as auth:
            counts[cluster] = len(auth.list_accounts(admin_token(deployment, cluster)))
    return counts


@pytest.mark.long  # a deployment of its own, several jobs (`make test-faults`)
def test_one_login_then_jobs_without_deployment_or_credentials_and_no_new_account(
    deployment: LocalDeployment, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    contexts = tmp_path / "config" / "contexts.json"
    monkeypatch.setenv("NEBULA_CONTEXTS", str(contexts))
    user = f"carol-{secrets.token_hex(2)}"
    creds = {c: {"username": user, "password": create_account(deployment, c, user)} for c in ("a", "b")}
    creds_file = tmp_path / "carol.yaml"
    creds_file.write_text(yaml.safe_dump(creds))
    (tmp_path / "dep").mkdir()
    deployment.write_description(tmp_path / "dep" / "deployment.json")  # as `nebula local up` writes it
    run = str(tmp_path / "dep")

    code, out, err = nebula("login", "--deployment", run, "--credentials", str(creds_file), "--json")
    assert code == 0, err
    assert json.loads(out)["accounts"] == {"a": user, "b": user} and json.loads(out)["current"]
    assert contexts.stat().st_mode & 0o777 == 0o600 and contexts.parent.stat().st_mode & 0o777 == 0o700

    before = accounts(deployment)
    spec = str(builtin_spec("numbers"))
    submitted = []
    for _ in range(3):
        code, out, err = nebula("job", "submit", spec, "--set", "steps=2", "--json", str(tmp_path / "s.json"))
        assert code == 0, out + err
        submitted.append(json.loads((tmp_path / "s.json").read_text())["job_id"])
    assert accounts(deployment) == before, "a submit created an account"
    code, out, err = nebula("job", "list", "--json")
    assert code == 0, err
    listed = {job["job_id"]: job for job in json.loads(out)}
    assert set(submitted) <= set(listed) and all(
        j["owners"] == {"a": user, "b": user} for j in listed.values()
    )
    code, out, _ = nebula("context", "list", "--json")
    assert [c["accounts"] for c in json.loads(out) if c["current"]] == [{"a": user, "b": user}]
    assert creds["a"]["password"] not in out  # listing never shows a password

    # A wrong password keeps nothing: the context stays as it was.
    code, _, err = nebula(
        "login",
        "--deployment",
        run,
        "--username",
        user,
        "--password-stdin",
        "--context",
        "wrong",
        stdin="not-the-password\n",
    )
    assert code == 1 and "error:" in err, err
    code, out, _ = nebula("context", "list", "--json")
    assert [c["name"] for c in json.loads(out)] == [f"dep@{user}"]

    code, out, _ = nebula("logout", "--json")
    assert code == 0 and json.loads(out)["accounts"]["a"] == user
    code, _, err = nebula("job", "submit", spec)
    assert code == 2 and "no current context" in " ".join(err.split()), err
    code, _, err = nebula("job", "submit", spec, "--deployment", run)
    assert code == 2 and "nebula login --deployment" in " ".join(err.split()), err
    assert accounts(deployment) == before

    contexts.write_text("{not json")
    code, _, err = nebula("job", "list")
    assert code == 1 and str(contexts) in "".join(err.split()), err  # named (rich may wrap it anywhere)
    code, _, err = nebula("context", "list")
    assert code == 1 and "not a contexts file" in " ".join(err.split()), err
