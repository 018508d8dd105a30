"""A local deployment's run directory: checked before anything starts, held by one deployment at a time.

Starting again on an existing run directory reuses everything in it, so a partial or corrupt one
must be refused before a single file is written: an account database whose admin password file is
gone would get a new password that no longer matches the stored hash. The lock file holds the pid
of the ``nebula local up`` (or ``nebula cluster up``) that owns the directory, so ``status`` and
``down`` can name it.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from nebula_common.errors import NebulaError

LOCK_FILE = ".nebula-local.lock"
_SQLITE_MAGIC = b"SQLite format 3\x00"


class LocalDeploymentError(NebulaError):
    pass


def check_run_dir(run_dir: Path, clusters: tuple[str, ...]) -> dict[str, str | None]:
    """Check an existing run directory before anything is started or written.

    Returns each cluster's admin password to reuse (None: none yet, a new one is made). Raises
    LocalDeploymentError naming the file when the directory is partial or corrupt, e.g. an account
    database whose admin password file is gone (a new password would not match the stored hash).
    """
    if run_dir.exists() and not run_dir.is_dir():
        raise LocalDeploymentError(f"run directory {run_dir} exists and is not a directory")
    passwords: dict[str, str | None] = {}
    for cluster in clusters:
        password_file = run_dir / cluster / "admin-password"
        database = run_dir / cluster / "auth" / "accounts.db"
        if database.exists():
            try:
                with database.open("rb") as db:
                    head = db.read(len(_SQLITE_MAGIC))
            except OSError as exc:
                raise LocalDeploymentError(f"cannot read {database}: {exc.strerror or exc}") from None
            if head and head != _SQLITE_MAGIC:
                raise LocalDeploymentError(
                    f"{database} is not a SQLite database (corrupt run directory); "
                    "restore it from a backup or start in a new --run-dir"
                )
        if password_file.exists() or password_file.is_symlink():
            if not password_file.is_file():
                raise LocalDeploymentError(f"{password_file} is not a regular file")
            try:
                password = password_file.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise LocalDeploymentError(f"cannot read {password_file}: {exc}") from None
            if not password:
                raise LocalDeploymentError(
                    f"{password_file} is empty; the admin's password is lost. Restore the file or start "
                    "in a new --run-dir (nothing was changed)"
                )
            passwords[cluster] = password
        elif database.exists():
            raise LocalDeploymentError(
                f"{password_file} is missing but cluster {cluster!r} already has accounts ({database}); "
                "a new admin password would not match the stored one. Restore the file or start in a "
                "new --run-dir (nothing was changed)"
            )
        else:
            passwords[cluster] = None
    return passwords


def lock_run_dir(run_dir: Path) -> IO[str]:
    """Hold an exclusive lock on the run directory for the deployment's life (one `up` per dir)."""
    handle = (run_dir / LOCK_FILE).open("a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise LocalDeploymentError(
            f"run directory {run_dir} is in use by another deployment (pid {holder}); stop it first"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def running_deployment_pid(run_dir: Path) -> int | None:
    """The pid of the `nebula local up` holding ``run_dir``'s lock, or None if none holds it."""
    path = run_dir / LOCK_FILE
    if not path.exists():
        return None
    with path.open("r", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            text = handle.read().strip()
            return int(text) if text.isdigit() else None
        fcntl.flock(handle, fcntl.LOCK_UN)
        return None
