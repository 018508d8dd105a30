"""Where a local deployment's switch serves its edge socket, and who sees it.

Under ``nebula local up`` and ``nebula cluster up`` every stage carries its edges as records on the
switch's edge socket (``services/switch/edge_socket.py``), on connections its trainer makes and passes
to it. The socket lives in a directory of its own under the cluster's run directory, which the
launcher binds into the switch's box (read-write: the switch makes the socket) and the trainer's
(read-only: connecting needs no write access to the directory); no stage box gets it. The directory is
``0711``: the trainer may run as a user of its own, and what decides who opens an edge is the one-time
ticket, not the file's mode.
"""

from __future__ import annotations

import os
from pathlib import Path


def edge_socket_path(run_dir: Path, cluster: str) -> Path:
    """The switch's edge socket of ``cluster``, its directory made. A path longer than a Unix socket
    address holds is bound and reached through its directory's descriptor
    (``nebula_common/rpc/unix_paths.py``), so every run directory gets records edges."""
    directory = Path(run_dir) / cluster / "edges"
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o711)
    return directory / "switch.sock"


__all__ = ["edge_socket_path"]
