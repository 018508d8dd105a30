"""Credentials files: 0600 in a 0700 folder, never overwritten by a second create, rotation keeps the rest."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import yaml

from nebula_common.credentials import (
    CredentialsError,
    credentials_file,
    read_passwords,
    store_new,
    store_rotated,
)

pytestmark = pytest.mark.timeout(30)


def test_a_new_file_is_private_and_in_the_shape_job_submit_reads(tmp_path: Path) -> None:
    path = store_new(tmp_path, "alice", {"a": "pw-a-123456789", "b": "pw-b-123456789"})
    assert path == tmp_path / "credentials" / "alice.yaml"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert yaml.safe_load(path.read_text()) == {
        "a": {"username": "alice", "password": "pw-a-123456789"},
        "b": {"username": "alice", "password": "pw-b-123456789"},
    }
    assert read_passwords(tmp_path, "alice") == {"a": "pw-a-123456789", "b": "pw-b-123456789"}


def test_an_existing_file_is_never_overwritten(tmp_path: Path) -> None:
    path = store_new(tmp_path, "alice", {"a": "first-password"})
    before = path.read_bytes()
    with pytest.raises(CredentialsError, match="already exists; it was left unchanged"):
        store_new(tmp_path, "alice", {"a": "second-password"})
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["alice.yaml"]  # no temp file left


def test_rotation_replaces_one_cluster_and_keeps_the_others(tmp_path: Path) -> None:
    store_new(tmp_path, "bob", {"a": "old-a-password", "b": "old-b-password"})
    path = store_rotated(tmp_path, "bob", "b", "new-b-password")
    assert read_passwords(tmp_path, "bob") == {"a": "old-a-password", "b": "new-b-password"}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_passwords(tmp_path, "nobody") == {}


@pytest.mark.parametrize("name", ["../evil", "a/b", "..", "x", "UPPER", ""])
def test_an_account_name_cannot_leave_the_folder(tmp_path: Path, name: str) -> None:
    with pytest.raises(CredentialsError, match="invalid account name"):
        credentials_file(tmp_path, name)


def test_a_damaged_file_is_named(tmp_path: Path) -> None:
    path = store_new(tmp_path, "carol", {"a": "some-password"})
    path.write_bytes(b"\xff\xfe garbage")
    with pytest.raises(CredentialsError, match=r"carol\.yaml: the file is UTF-16 encoded"):
        read_passwords(tmp_path, "carol")
    path.write_text("a: just-a-string\n")
    with pytest.raises(CredentialsError, match=r"carol\.yaml: a: needs a password"):
        read_passwords(tmp_path, "carol")
