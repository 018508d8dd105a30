"""The trainer's box under ``nebula local up`` / ``cluster up``: its directories, user and control groups.

The trainer is boxed like every other service (``service_box.py``: an empty root with the system, the
code, its own identity and data directory; a private ``/tmp`` and ``/proc``), so it reads no other
service's key, no admin password and no other deployment's files. It differs in two ways:

* It makes the boxes of its stages, so its box lets it create namespaces (no seccomp filter; the
  stages' own boxes carry theirs) and, when the launcher runs as root, it runs as a user of its own
  (``userns.TRAINER_UID``) rather than as root: ``box_entry`` switches to it. Its data directory and
  identity are then given to that user (a renewed key follows: ``durable.atomic_write`` writes a
  file in a directory of another user's as that user), and so are one control-group folder per
  controller (cgroup v1: ``pids``, ``memory``) in which it makes its stages' groups
  (``NEBULA_TRAINER_STAGE_CGROUP``). On a cgroup v2 host nothing is delegated yet: its stages run
  without a group, which the trainer says at start-up.
* Pre-trained weights a job names by absolute path are read in the cluster's filesystem, which for a
  boxed trainer is what it sees: the folders given with ``nebula local up --share`` (read-only), as
  a compose trainer sees its volumes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pwd
from dataclasses import dataclass, field
from pathlib import Path

from nebula_common.errors import NebulaError
from nebula_common.launcher.service_box import ServiceBox
from nebula_common.launcher.userns import TRAINER_UID

CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("pids", "memory")
KEPT_AS_ROOT = ("signer",)
"""Folders of the trainer's data directory that stay root's: the audit signer makes its socket there."""


@dataclass
class TrainerBox:
    """One cluster's trainer box: what it is given, and the settings that tell the trainer."""

    data_dir: Path
    identity_dir: Path | None
    shares: tuple[Path, ...] = ()
    cgroup_root: Path = CGROUP_ROOT
    delegated: tuple[Path, ...] = field(default=(), init=False)
    """The control-group folders ``prepare`` made for this trainer and gave to its user."""

    @property
    def cgroup_parent(self) -> str:
        """This trainer's folder under each controller: one per run directory and cluster."""
        digest = hashlib.sha256(str(self.data_dir).encode()).hexdigest()[:12]
        return f"nebula-stages/trainer-{digest}"

    def prepare(self) -> dict[str, str]:
        """Give the trainer's user what it owns (root only); the trainer's settings for it."""
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)
        if os.geteuid() != 0:
            return {}
        _check_unused(TRAINER_UID)
        _give(self.data_dir, skip=KEPT_AS_ROOT)
        if self.identity_dir is not None:
            _give(self.identity_dir)
        self.delegated = self._delegate()
        return {"STAGE_CGROUP": self.cgroup_parent} if self.delegated else {}

    def _delegate(self) -> tuple[Path, ...]:
        """Make this trainer's control-group folders and give them to its user (cgroup v1, root)."""
        if (self.cgroup_root / "cgroup.controllers").exists():
            return ()
        folders = []
        for controller in CONTROLLERS:
            base = self.cgroup_root / controller
            if not (base / "cgroup.procs").exists():
                continue
            folder = base / self.cgroup_parent
            try:
                folder.mkdir(parents=True, exist_ok=True)
                for path in (folder, folder / "cgroup.procs", folder / "tasks"):
                    os.chown(path, TRAINER_UID, TRAINER_UID)
            except OSError:
                continue  # the trainer finds no writable group and says so
            folders.append(folder)
        return tuple(folders)

    def box(self) -> ServiceBox:
        read_only = (*((self.identity_dir,) if self.identity_dir is not None else ()), *self.shares)
        return ServiceBox(
            read_only=read_only, read_write=(self.data_dir, *self.delegated), nests=True, user=TRAINER_UID
        )

    def release(self) -> None:
        """Remove this trainer's control-group folders (empty once its stages' groups are gone)."""
        for folder in self.delegated:
            with contextlib.suppress(OSError):
                folder.rmdir()
        self.delegated = ()


def _check_unused(uid: int) -> None:
    """The trainer's user must be nobody else's: a user of that id could signal it or read its memory."""
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return
    raise NebulaError(
        f"the boxed trainer runs as user id {uid}, but that id belongs to user {name!r} on this machine; "
        "run the deployment as a user other than root (the trainer then runs as that user) or free the id"
    )


def _give(root: Path, skip: tuple[str, ...] = ()) -> None:
    """``root`` and everything below it to the trainer's user, but the folders named in ``skip``."""
    os.chown(root, TRAINER_UID, TRAINER_UID)
    for directory, folders, files in os.walk(root):
        if Path(directory) == root:
            folders[:] = [name for name in folders if name not in skip]
        for name in (*folders, *files):
            with contextlib.suppress(FileNotFoundError):
                os.chown(Path(directory) / name, TRAINER_UID, TRAINER_UID, follow_symlinks=False)


__all__ = ["TrainerBox"]
