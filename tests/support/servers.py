"""Real Nebula services started in-process, each on its own event loop in a daemon thread.

Tests drive them with the synchronous SDK clients, as the CLI and the services' start-up code do;
an asyncio server cannot share the test's thread without every test becoming a coroutine.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from nebula_common.pki import ClusterPaths
from nebula_common.rpc import ServiceServer
from services.auth.config import AuthSettings
from services.auth.server import SERVICE as AUTH_SERVICE
from services.switch.config import SwitchSettings
from services.switch.server import SERVICE as SWITCH_SERVICE
from services.switch.server import RunningSwitch
from tests.support.service_thread import ServiceThread

T = TypeVar("T")


class AuthServerThread(ServiceThread[ServiceServer]):
    """An auth server, started as its process starts it, on a private event loop."""

    def __init__(self, settings: AuthSettings) -> None:
        super().__init__(AUTH_SERVICE, settings, timeout=30)

    @property
    def server(self) -> ServiceServer:
        return self.handle


class SwitchThread(ServiceThread[RunningSwitch]):
    """A switch, started as its process starts it, on a private event loop."""

    def __init__(self, settings: SwitchSettings) -> None:
        super().__init__(SWITCH_SERVICE, settings, timeout=40)

    @property
    def running(self) -> RunningSwitch:
        return self.handle

    @property
    def internal_address(self) -> str:
        """The cluster-internal Relay/AuditLog address (plaintext, token-authenticated)."""
        return f"127.0.0.1:{self.running.internal_port}"


@contextmanager
def running_auth(settings: AuthSettings) -> Iterator[AuthServerThread]:
    """An auth server for the duration of the ``with`` block, stopped even if the block fails."""
    auth = AuthServerThread(settings)
    try:
        yield auth
    finally:
        auth.stop()


@contextmanager
def accepting_switch(
    work: Path, paths: ClusterPaths, peer_cluster_id: str, auth_address: str, **settings: Any
) -> Iterator[SwitchThread]:
    """The switch of ``paths.cluster_id`` accepting its peer's link, with state under ``work/switch``.

    Only ``accept`` is offered: a dialing switch would need a running peer, which in-process tests
    of one cluster do not have. ``settings``: more of its ``SwitchSettings``.
    """
    switch = SwitchThread(
        SwitchSettings(
            cluster_id=paths.cluster_id,
            peer_cluster_id=peer_cluster_id,
            link_role="accept",
            tls_cert=paths.switch_cert,
            tls_key=paths.switch_key,
            trust_bundle=paths.trust_bundle,
            auth_address=auth_address,
            data_dir=work / "switch",
            metrics_port=-1,
            **settings,
        )
    )
    try:
        yield switch
    finally:
        switch.stop()
