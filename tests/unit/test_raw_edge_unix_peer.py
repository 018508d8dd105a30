"""A trainer sends a Unix socket edge's ticket only to a switch of its own uid.

The Unix socket edge has no TLS, so the trainer must know who listens before it hands over the
one-time ticket: a socket that another user put at the path (or a path another user can change) is
refused, and the impostor reads nothing.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.trainer.edge.raw_transport import _connect_unix

IMPOSTOR = textwrap.dedent(
    """
    import os, socket, sys
    uid = int(sys.argv[2])
    if uid != os.getuid():
        os.setgid(uid)
        os.setuid(uid)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sys.argv[1])
    listener.listen(1)
    print("listening", flush=True)
    conn, _ = listener.accept()
    conn.settimeout(3)
    try:
        data = conn.recv(100)
    except OSError:
        data = b""
    print("received", len(data), flush=True)
    """
)


def serve(path: Path, uid: int) -> subprocess.Popen[str]:
    server = subprocess.Popen(
        [sys.executable, "-c", IMPOSTOR, str(path), str(uid)], stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None and server.stdout.readline().strip() == "listening"
    return server


def test_a_socket_of_this_uid_is_connected(tmp_path: Path) -> None:
    directory = tmp_path / "edge"
    directory.mkdir(mode=0o700)
    server = serve(directory / "edge.sock", os.getuid())
    sock = _connect_unix(str(directory / "edge.sock"))
    sock.sendall(b"ticket")
    sock.close()
    out, _ = server.communicate(timeout=10)
    assert "received 6" in out


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory other users can reach (pytest's own are closed to them)."""
    top = Path(tempfile.mkdtemp(prefix="nebula-unix-edge-"))
    top.chmod(0o755)
    try:
        yield top
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_a_listener_of_another_uid_never_receives_the_ticket(open_dir: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to run the impostor as another user")
    nobody = pwd.getpwnam("nobody").pw_uid
    directory = open_dir / "edge"
    directory.mkdir()
    directory.chmod(0o777)  # a place another user could write to: the impostor binds there
    path = directory / "edge.sock"
    server = serve(path, nobody)
    with pytest.raises(PermissionError, match="belongs to uid 0 with mode 777"):
        _connect_unix(str(path))  # the directory is open to others
    directory.chmod(0o700)
    with pytest.raises(PermissionError, match=f"not a socket of this trainer's uid {os.getuid()}"):
        _connect_unix(str(path))  # the socket is another user's
    os.lchown(path, os.getuid(), os.getgid())  # the path looks right; the listener is still nobody's
    with pytest.raises(PermissionError, match=rf"served by pid \d+ of uid {nobody}, not by a switch"):
        _connect_unix(str(path))
    out, _ = server.communicate(timeout=10)
    assert "received 0" in out  # it saw a connection, and not one byte of a ticket


def test_a_file_in_the_way_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "edge"
    directory.mkdir(mode=0o700)
    (directory / "edge.sock").write_text("not a socket")
    with pytest.raises(PermissionError, match="not a socket"):
        _connect_unix(str(directory / "edge.sock"))
    assert socket.AF_UNIX  # the platform has Unix sockets
