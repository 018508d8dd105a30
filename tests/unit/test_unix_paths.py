"""A Unix socket at a path longer than ``sun_path`` holds is bound and reached through its directory."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import pytest

from nebula_common.rpc.unix_paths import SUN_PATH_LIMIT, bind_unix, connect_unix


def test_a_socket_deeper_than_an_address_holds_is_bound_in_its_real_directory_and_reached(
    tmp_path: Path,
) -> None:
    deep = tmp_path.joinpath(*["a-long-directory-name-of-a-run"] * 5)
    deep.mkdir(parents=True)
    path = deep / "switch.sock"
    assert len(os.fsencode(path)) > SUN_PATH_LIMIT
    descriptors = len(os.listdir("/proc/self/fd"))
    with socket.socket(socket.AF_UNIX) as plain, pytest.raises(OSError):
        plain.bind(str(path))  # what the kernel says without the directory's descriptor
    with socket.socket(socket.AF_UNIX) as server, socket.socket(socket.AF_UNIX) as client:
        bind_unix(server, str(path))
        server.listen(1)
        assert path.is_socket() and not any(deep.parent.glob("switch.sock"))
        connect_unix(client, str(path))
        accepted, _ = server.accept()
        with accepted:
            client.sendall(b"ok")
            assert accepted.recv(2) == b"ok"
    assert len(os.listdir("/proc/self/fd")) == descriptors, "the directory's descriptor was not closed"


def test_a_short_path_is_used_as_it_is_and_a_name_too_long_alone_is_refused(tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as server:
        bind_unix(server, str(tmp_path / "s.sock"))
        assert server.getsockname() == str(tmp_path / "s.sock")
    with socket.socket(socket.AF_UNIX) as server, pytest.raises(OSError) as raised:
        bind_unix(server, str(tmp_path / ("n" * 120)))
    assert raised.value.errno == errno.ENAMETOOLONG and "file name alone is too long" in str(raised.value)
