"""``python -m services.signer.adopt``: a deployment's one-shot that hands old audit keys to the signer.

Compose's ``signer-init-<cluster>`` and the Kubernetes pods' ``adopt-audit-key`` run it before the
signer and the services start. The key must be moved whole (its old seals still verify), never left
where the service reads it, and a key in both places or a bad argument stops it with a message naming
what is wrong, moving nothing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nebula_common.audit.signing import PRIVATE_KEY_NAME, AuditSigner
from services.signer.adopt import main


def _service_key(directory: Path) -> bytes:
    directory.mkdir(parents=True, exist_ok=True)
    AuditSigner.load_or_create(directory)
    return (directory / PRIVATE_KEY_NAME).read_bytes()


def test_each_services_key_moves_to_the_signer_and_a_second_run_is_a_no_op(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    auth, switch, keys = tmp_path / "auth", tmp_path / "switch", tmp_path / "signer"
    key = _service_key(auth)
    switch.mkdir()  # a fresh service: nothing to move
    assert main(["--keys", str(keys), f"auth={auth}", f"switch={switch}"]) == 0
    assert not (auth / PRIVATE_KEY_NAME).exists()
    assert (keys / "auth" / PRIVATE_KEY_NAME).read_bytes() == key
    assert (keys / "auth").stat().st_mode & 0o777 == 0o700
    assert not (keys / "switch").exists()
    assert "moved the audit key of auth" in capsys.readouterr().out
    assert main(["--keys", str(keys), f"auth={auth}", f"switch={switch}"]) == 0
    assert (keys / "auth" / PRIVATE_KEY_NAME).read_bytes() == key


def test_a_key_in_both_places_stops_it_and_nothing_moves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    auth, keys = tmp_path / "auth", tmp_path / "signer"
    old, new = _service_key(auth), _service_key(keys / "auth")
    assert main(["--keys", str(keys), f"auth={auth}"]) == 1
    err = capsys.readouterr().err
    assert "are both audit keys of auth" in err and "Traceback" not in err
    assert (auth / PRIVATE_KEY_NAME).read_bytes() == old
    assert (keys / "auth" / PRIVATE_KEY_NAME).read_bytes() == new


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("auth", "expected <log>=<absolute data directory"),
        ("auth=relative/dir", "expected <log>=<absolute data directory"),
        ("not a name=/x", "expected <log>=<absolute data directory"),
        ("auth=/nonexistent/nebula-data", "no such directory (the data directory of auth)"),
    ],
)
def test_bad_arguments_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], entry: str, message: str
) -> None:
    assert main(["--keys", str(tmp_path / "signer"), entry]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "signer").exists()


def test_the_module_runs_as_the_deployments_run_it(tmp_path: Path) -> None:
    """The exact command line of compose and Kubernetes: ``python -m services.signer.adopt``."""
    key = _service_key(tmp_path / "data")
    keys = tmp_path / "signer"
    done = subprocess.run(
        [sys.executable, "-m", "services.signer.adopt", "--keys", str(keys), f"data={tmp_path / 'data'}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (keys / "data" / PRIVATE_KEY_NAME).read_bytes() == key


def test_a_key_on_another_volume_is_copied_whole_then_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two volumes (compose, Kubernetes): rename fails with EXDEV, so the key is written, synced, renamed."""
    import errno
    import os

    auth, keys = tmp_path / "auth", tmp_path / "signer"
    key = _service_key(auth)
    real_replace = os.replace

    def across_volumes(src: str | Path, dst: str | Path) -> None:
        if Path(src) == auth / PRIVATE_KEY_NAME:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", across_volumes)
    assert main(["--keys", str(keys), f"auth={auth}"]) == 0
    assert (keys / "auth" / PRIVATE_KEY_NAME).read_bytes() == key
    assert (keys / "auth" / PRIVATE_KEY_NAME).stat().st_mode & 0o777 == 0o600
    assert not (auth / PRIVATE_KEY_NAME).exists()
