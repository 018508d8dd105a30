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

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

SOCKET_PATH_LIMIT = 107
"""Longest path a Unix socket can be bound at (``sun_path`` is 108 bytes with its terminating zero)."""


def edge_socket_path(run_dir: Path, cluster: str) -> Path | None:
    """The switch's edge socket of ``cluster``, its directory made; None if the path is too long to bind
    (the deployment then keeps gRPC edges for this cluster, and says so)."""
    directory = Path(run_dir) / cluster / "edges"
    path = directory / "switch.sock"
    if len(os.fsencode(path)) > SOCKET_PATH_LIMIT:
        log.warning(
            "the run directory's path is too long for a Unix socket: this cluster's stages carry their "
            "edges over gRPC through their trainer's proxy",
            extra={"fields": {"cluster": cluster, "path": str(path)}},
        )
        return None
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o711)
    return path


__all__ = ["SOCKET_PATH_LIMIT", "edge_socket_path"]
