"""`nebula local up` on an existing run dir: reuse what is there, refuse what is broken, overwrite nothing."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nebula_common.cli.app import app
from nebula_common.launcher.run_dir import (
    LOCK_FILE,
    LocalDeploymentError,
    check_run_dir,
    lock_run_dir,
)
from nebula_common.pki import init_pki

pytestmark = pytest.mark.timeout(60)
CLUSTERS = ("a", "b")


def existing_run(tmp_path: Path) -> Path:
    """A run directory as a first `nebula local up` leaves it (PKI, passwords, account databases)."""
    run = tmp_path / "run"
    init_pki(run / "pki", list(CLUSTERS))
    for cluster in CLUSTERS:
        (run / cluster / "auth").mkdir(parents=True)
        (run / cluster / "admin-password").write_text(f"pw-{cluster}-0123456789abcdef")
        with sqlite3.connect(run / cluster / "auth" / "accounts.db") as db:
            db.execute("create table t (x)")
    return run


def snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_a_fresh_directory_gets_new_passwords() -> None:
    assert check_run_dir(Path("/nonexistent/run"), CLUSTERS) == {"a": None, "b": None}


def test_existing_passwords_are_reused(tmp_path: Path) -> None:
    run = existing_run(tmp_path)
    assert check_run_dir(run, CLUSTERS) == {"a": "pw-a-0123456789abcdef", "b": "pw-b-0123456789abcdef"}


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda run: (run / "a" / "admin-password").unlink(), r"a/admin-password is missing .* accounts"),
        (lambda run: (run / "b" / "admin-password").write_text("  \n"), r"b/admin-password is empty"),
        (
            lambda run: (run / "a" / "auth" / "accounts.db").write_bytes(b"garbage" * 10),
            r"a/auth/accounts.db is not a SQLite database",
        ),
    ],
)
def test_a_damaged_run_dir_is_named_and_left_alone(
    tmp_path: Path, damage: Callable[[Path], object], message: str
) -> None:
    run = existing_run(tmp_path)
    damage(run)
    with pytest.raises(LocalDeploymentError, match=message):
        check_run_dir(run, CLUSTERS)
    before = snapshot(run)
    result = CliRunner().invoke(app, ["local", "up", "--run-dir", str(run)])
    assert result.exit_code == 1, result.output
    assert "Error:" in result.output and "Traceback" not in result.output
    after = snapshot(run)
    after.pop(LOCK_FILE, None)
    assert after == before  # nothing written, nothing started


def test_a_partial_pki_is_refused_with_its_reason(tmp_path: Path) -> None:
    run = existing_run(tmp_path)
    (run / "pki" / "a" / "switch.key").unlink()
    before = snapshot(run)
    result = CliRunner().invoke(app, ["local", "up", "--run-dir", str(run)])
    assert result.exit_code == 1, result.output
    assert "PKI in" in result.output and "Refusing to overwrite" in result.output
    assert "Traceback" not in result.output
    after = snapshot(run)
    after.pop(LOCK_FILE, None)
    assert after == before


def test_one_deployment_per_run_dir(tmp_path: Path) -> None:
    run = existing_run(tmp_path)
    held = lock_run_dir(run)
    try:
        result = CliRunner().invoke(app, ["local", "up", "--run-dir", str(run)])
        assert result.exit_code == 1
        assert "is in use by another deployment" in result.output
    finally:
        held.close()
    lock_run_dir(run).close()  # released: the next one gets it
