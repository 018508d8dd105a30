"""The edge socket's listeners: a Unix socket on the switch's host, or a TCP port across hosts."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path

from nebula_common.rpc.unix_paths import bind_unix


def bind_socket(path: Path) -> socket.socket:
    """A listening Unix socket at ``path``: a previous run's socket is replaced, anything else refused.

    Mode 0666: the trainer may run as another user (its own box's); the ticket, not the mode, decides
    who opens an edge, and the directory the deployment puts it in decides who reaches it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ValueError(f"NEBULA_SWITCH_EDGE_SOCKET {path}: exists and is not a socket")
        path.unlink()

    def bind(listener: socket.socket) -> None:
        bind_unix(listener, str(path))  # at any depth (``unix_paths.py``)
        os.chmod(path, 0o666)

    return _listening(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), bind)


def bind_tcp(address: str) -> socket.socket:
    """A listening TCP socket at host:port (the edge socket across hosts)."""
    host, _, port = address.rpartition(":")
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET

    def bind(listener: socket.socket) -> None:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host.strip("[]"), int(port)))

    return _listening(socket.socket(family, socket.SOCK_STREAM), bind)


def _listening(listener: socket.socket, bind: Callable[[socket.socket], None]) -> socket.socket:
    """``listener`` bound by ``bind``, listening and non-blocking (closed if any step fails)."""
    try:
        bind(listener)
        listener.listen(128)
        listener.setblocking(False)
    except BaseException:
        listener.close()
        raise
    return listener


def host_port(address: object) -> str:
    """``host:port`` (``[host]:port`` for IPv6) of an accepted connection's address."""
    if isinstance(address, tuple) and len(address) >= 2:
        host, port = address[0], address[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(address)


__all__ = ["bind_socket", "bind_tcp", "host_port"]
