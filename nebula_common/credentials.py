"""Account passwords a command created, kept where their owner can find them again: the run directory.

Why a file at all: a password generated for a new account (``nebula account create``, ``passwd``) is
shown once; if the terminal scrolls away it is gone, and the account with it. So each one is also
written to ``<run dir>/credentials/<username>.yaml`` (directory 0700, file 0600), in exactly the
shape ``nebula job submit --credentials`` reads: ``{<cluster>: {username, password}}``.

A new file is created with a link (``durable.create_new``): an existing one is never overwritten, so a
second ``create`` or a restarted deployment cannot destroy a password someone still needs. Rotating a
password (``passwd``) replaces that one cluster's entry atomically.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml

from nebula_common.durable import atomic_write, create_new
from nebula_common.errors import NebulaError
from nebula_common.safe_yaml import YamlInputError, load_yaml_file

CREDENTIALS_DIR = "credentials"
_USERNAME = re.compile(r"^[a-z0-9][a-z0-9._-]{2,63}$")


class CredentialsError(NebulaError):
    """A credentials file that cannot be written or read; the message names it."""


def credentials_file(run_dir: Path, username: str) -> Path:
    if not _USERNAME.fullmatch(username):  # also keeps the name a plain file name (no '/', no '..')
        raise CredentialsError(f"invalid account name {username!r}: 3-64 characters of a-z 0-9 . _ -")
    return run_dir / CREDENTIALS_DIR / f"{username}.yaml"


def _private_dir(run_dir: Path) -> Path:
    folder = run_dir / CREDENTIALS_DIR
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    return folder


def _render(entries: dict[str, str], username: str) -> bytes:
    data = {cluster: {"username": username, "password": password} for cluster, password in entries.items()}
    header = "# Shown once by `nebula account`; use with `nebula job submit --credentials FILE`.\n"
    return (header + yaml.safe_dump(data, sort_keys=True)).encode()


def store_new(run_dir: Path, username: str, passwords: dict[str, str]) -> Path:
    """Write a new credentials file (0600) for ``username``; an existing file is an error, never replaced."""
    path = credentials_file(run_dir, username)
    _private_dir(run_dir)
    if not create_new(path, _render(passwords, username), mode=0o600):
        raise CredentialsError(f"{path} already exists; it was left unchanged")
    return path


def read_passwords(run_dir: Path, username: str) -> dict[str, str]:
    """Cluster -> password from ``username``'s credentials file ({} if there is none)."""
    path = credentials_file(run_dir, username)
    if not path.exists():
        return {}
    try:
        data = load_yaml_file(path)
    except YamlInputError as exc:
        raise CredentialsError(str(exc)) from None
    if not isinstance(data, dict):
        raise CredentialsError(f"{path}: expected a mapping cluster -> {{username, password}}")
    passwords = {}
    for cluster, entry in data.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("password"), str):
            raise CredentialsError(f"{path}: {cluster}: needs a password")
        passwords[str(cluster)] = entry["password"]
    return passwords


def store_rotated(run_dir: Path, username: str, cluster: str, password: str) -> Path:
    """Record ``username``'s new password in ``cluster``, keeping the other clusters' entries (0600)."""
    path = credentials_file(run_dir, username)
    _private_dir(run_dir)
    entries = read_passwords(run_dir, username)
    entries[cluster] = password
    atomic_write(path, _render(entries, username), mode=0o600)
    return path
