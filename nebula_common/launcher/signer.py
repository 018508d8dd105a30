"""The cluster's audit signer under ``nebula local up`` / ``cluster up``: where its keys and sockets live.

One signer process per cluster (``services/signer``) holds the seal keys of every service that writes an
audit log; each service reaches it only through a socket in its own directory
(``<run>/<cluster>/<service>/signer/signer.sock``), so no service reads a seal key and each seals only
its own log. The keys live in ``<run>/<cluster>/signer/<service>/``, a directory only the signer's box
shows. A run directory from before the signer holds each service's key beside its log: it is moved to
the signer's directory before anything starts (the same key, so old seals still verify).
"""

from __future__ import annotations

import os
from pathlib import Path

from nebula_common.audit.signing import AuditKeyError, adopt_key
from nebula_common.errors import NebulaError
from nebula_common.launcher.service_box import ServiceBox

__all__ = ["SIGNED", "SignerLayout", "signer_layout"]

SIGNED = ("auth", "data", "switch", "trainer")
"""Services whose audit logs the signer seals (the codec service writes none)."""


class SignerLayout:
    """One cluster's signer: its key directory and each signed service's socket."""

    def __init__(self, run_dir: Path, cluster: str) -> None:
        self.keys = run_dir / cluster / "signer"
        self.sockets = {service: run_dir / cluster / service / "signer" / "signer.sock" for service in SIGNED}

    def setting(self) -> str:
        """``NEBULA_SIGNER_SOCKETS``."""
        return ",".join(f"{service}={path}" for service, path in self.sockets.items())

    def target(self, service: str) -> str:
        """``NEBULA_<SERVICE>_AUDIT_SIGNER``."""
        return f"unix:{self.sockets[service]}"

    def box(self) -> ServiceBox:
        """The signer sees its keys and the sockets' directories, nothing of the services' own."""
        return ServiceBox((), (self.keys, *(path.parent for path in self.sockets.values())), (), ())


def signer_layout(run_dir: Path, cluster: str) -> SignerLayout:
    """The directories made (0700) and each service's old audit key moved to the signer's."""
    layout = SignerLayout(run_dir, cluster)
    layout.keys.mkdir(mode=0o700, parents=True, exist_ok=True)
    for service, socket in layout.sockets.items():
        socket.parent.mkdir(mode=0o711, parents=True, exist_ok=True)
        os.chmod(socket.parent, 0o711)  # whatever the umask: a boxed trainer's user searches it
        # The service's own directory decides who reaches its socket (the signer leaves that open).
        os.chmod(socket.parent.parent, 0o700)
        try:
            adopt_key(socket.parent.parent, layout.keys / service, log=f"{service} in cluster {cluster}")
        except AuditKeyError as exc:
            raise NebulaError(str(exc)) from None
    return layout
