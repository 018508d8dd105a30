"""Real Nebula services started in-process, each on its own event loop in a daemon thread.

Tests drive them with the synchronous SDK clients, as the CLI and the services' start-up code do;
an asyncio server cannot share the test's thread without every test becoming a coroutine.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from nebula_common.pki import ClusterPaths
from services.auth.config import AuthSettings
from services.auth.server import AuthServer, run_auth_server
from services.switch.config import SwitchSettings
from services.switch.server import RunningSwitch, run_switch

T = TypeVar("T")


class LoopThread:
    """A private event loop running forever in a daemon thread; coroutines are submitted to it."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coroutine`` on the loop and wait for its result (re-raising its exception)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=timeout)

    def close(self) -> None:
        """Stop the loop and join the thread; call once, after the last ``run``."""
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


class AuthServerThread:
    """An auth server (``run_auth_server``, as its process starts it) on a private event loop."""

    def __init__(self, settings: AuthSettings) -> None:
        self._loop = LoopThread()
        try:
            self.server: AuthServer = self._loop.run(run_auth_server(settings), timeout=30)
        except BaseException:
            self._loop.close()
            raise

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.grpc_port}"

    def stop(self) -> None:
        try:
            self._loop.run(self.server.stop(0.5), timeout=30)
        finally:
            self._loop.close()


class SwitchThread:
    """A switch (``run_switch``, as its process starts it) on a private event loop."""

    def __init__(self, settings: SwitchSettings) -> None:
        self._loop = LoopThread()
        try:
            self.running: RunningSwitch = self._loop.run(run_switch(settings), timeout=40)
        except BaseException:
            self._loop.close()
            raise

    @property
    def internal_address(self) -> str:
        """The cluster-internal Relay/AuditLog address (plaintext, token-authenticated)."""
        return f"127.0.0.1:{self.running.internal_port}"

    def stop(self) -> None:
        try:
            self._loop.run(self.running.stop(0.5), timeout=30)
        finally:
            self._loop.close()


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
    work: Path, paths: ClusterPaths, peer_cluster_id: str, auth_address: str
) -> Iterator[SwitchThread]:
    """The switch of ``paths.cluster_id`` accepting its peer's link, with state under ``work/switch``.

    Only ``accept`` is offered: a dialing switch would need a running peer, which in-process tests
    of one cluster do not have.
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
        )
    )
    try:
        yield switch
    finally:
        switch.stop()
