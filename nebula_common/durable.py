"""Crash-safe file writes: the one place Nebula writes a whole file that must survive a crash.

Keys, certificates, CRLs, audit seals, token keys and dataset metadata are all small files that
are read back whole and trusted. A plain ``open(path, "wb").write(...)`` can leave such a file
empty or torn after a crash or power loss, and a reader would then fail (or, worse, trust half a
trust bundle). So every such write here:

1. writes a temporary file next to the target (same directory, so same file system), created with
   ``O_EXCL | O_NOFOLLOW`` (a planted file or symlink at the temp name is never followed or
   reused) and with the final ``mode`` from its first byte (a key is never readable by others,
   not even between create and chmod), then ``fchmod``s it so the umask cannot strip bits;
2. ``fsync``s the file, so its bytes are on disk before any name points at them;
3. publishes it under the target name in one atomic step: ``os.replace`` (:func:`atomic_write`,
   readers see the old or the new content, never a mix) or ``os.link`` (:func:`create_new`, which
   fails instead of overwriting, so racing creators agree on one winner);
4. ``fsync``s the directory, because the new directory entry itself may otherwise be lost on power
   loss even though the file's data was synced.

A failed write removes its temporary file and leaves the previous file untouched. This module sits
at the bottom of the shared library and imports nothing of Nebula, so any layer may use it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

__all__ = ["atomic_write", "create_new", "fsync_dir"]


def fsync_dir(directory: Path) -> None:
    """Make the entries of ``directory`` durable (a rename, link or unlink done in it just now).

    Without this, a file that was fsynced and renamed into place may still vanish (or reappear
    under its old name) after a power loss, because the directory update was only in memory.
    """
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _take_directory_owner(fd: int, directory: Path) -> None:
    """Run as root, a file written into a directory of another user's belongs to that user.

    The local launcher gives a boxed trainer a user of its own and its directories (``launcher/userns.py``),
    then renews the trainer's certificate and key in them: the trainer must still read them. A user who
    owns the directory could replace its files anyway, so this hands it nothing new.
    """
    if os.geteuid() != 0:
        return
    owner = os.stat(directory)
    if owner.st_uid != 0:
        os.fchown(fd, owner.st_uid, owner.st_gid)


def _write_temp(path: Path, data: bytes, mode: int) -> Path:
    """Write ``data`` to a fresh, fsynced temp file next to ``path`` with exactly ``mode``; its path.

    On any failure the temp file is removed before the exception propagates.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    # O_EXCL: never follow or reuse a pre-existing file (e.g. a planted symlink) at the temp name.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    try:
        try:
            os.fchmod(fd, mode)  # the umask may have stripped bits from a public file; be exact
            _take_directory_owner(fd, path.parent)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return tmp


def atomic_write(path: Path, data: bytes, *, mode: int) -> None:
    """Replace ``path`` with ``data`` (file mode ``mode``) so a crash leaves the old or the new file.

    An existing file at ``path`` is replaced whatever its mode was; ``path`` being a symlink
    replaces the link itself, never the file it points to.
    """
    path = Path(path)
    tmp = _write_temp(path, data, mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def create_new(path: Path, data: bytes, *, mode: int) -> bool:
    """Create ``path`` with ``data`` unless something already exists there; True if this call did.

    For files that must be created exactly once, such as a signing key: two processes starting at
    once both write a complete candidate, but only one is linked into place, and the loser (False)
    then reads the winner's file, so both end up using the same key. An existing file is never
    modified, and a reader never sees a partly written one.
    """
    path = Path(path)
    tmp = _write_temp(path, data, mode)
    try:
        os.link(tmp, path)
        created = True
    except FileExistsError:
        created = False
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    fsync_dir(path.parent)
    return created
