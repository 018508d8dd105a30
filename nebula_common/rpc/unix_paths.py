"""A Unix socket at any path: bind and connect through the directory's descriptor when the path is long.

Why: ``sun_path`` holds 107 bytes, and a deployment's run directory (a user's home, a CI workspace) can
make the switch's edge socket path longer. Falling back to another carrier there would make the data
path depend on where a user unpacked Nebula. Instead, a path that does not fit is reached as
``/proc/self/fd/<n>/<name>``, where ``<n>`` is an ``O_PATH`` descriptor of its directory held open for
the call: the kernel resolves the descriptor's magic link to the directory, so the socket is made in (or
found in) the real directory with its real permissions. Both ends need ``/proc`` (every Nebula box
mounts its own).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Iterator

SUN_PATH_LIMIT = 107
"""Longest path a Unix socket can be bound or connected at (``sun_path`` is 108 bytes with its zero)."""


def held_directory_path(path: str | os.PathLike[str]) -> tuple[int, str]:
    """(an ``O_PATH`` descriptor of ``path``'s directory, ``/proc/self/fd/<it>/<name>``): the caller
    closes the descriptor once the short name is no longer used (a gRPC channel reconnects through it)."""
    directory, name = os.path.split(os.fspath(path))
    descriptor = os.open(directory or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    short = f"/proc/self/fd/{descriptor}/{name}"
    if len(os.fsencode(short)) > SUN_PATH_LIMIT:
        os.close(descriptor)
        raise OSError(errno.ENAMETOOLONG, f"the socket's file name alone is too long: {name!r}")
    return descriptor, short


@contextlib.contextmanager
def socket_address(path: str) -> Iterator[str]:
    """A name that reaches ``path`` for ``bind`` or ``connect``, valid inside the ``with`` block."""
    if len(os.fsencode(path)) <= SUN_PATH_LIMIT:
        yield path
        return
    descriptor, short = held_directory_path(path)
    try:
        yield short
    finally:
        os.close(descriptor)


def bind_unix(sock: socket.socket, path: str) -> None:
    """``sock.bind`` at ``path``, however long (see the module doc)."""
    with socket_address(path) as address:
        sock.bind(address)


def connect_unix(sock: socket.socket, path: str) -> None:
    """``sock.connect`` to ``path``, however long (see the module doc)."""
    with socket_address(path) as address:
        sock.connect(address)


__all__ = ["SUN_PATH_LIMIT", "bind_unix", "connect_unix", "held_directory_path", "socket_address"]
