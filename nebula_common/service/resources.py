"""What most services acquire at start-up, each registered on the stack for ordered cleanup."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc

from nebula_common.audit import AuditLog, open_service_audit
from nebula_common.auth import TokenVerifier
from nebula_common.rpc import ServiceServer, create_server
from nebula_common.rpc.internal_tls import ClientTls
from nebula_common.service.host import acquire_in_thread
from nebula_common.service.identity import ServiceIdentity
from nebula_common.service.settings import ServiceSettings

AUTH_WAIT_S = 30.0
"""How long a service waits for its cluster's auth service at start-up (they often start together)."""


async def token_verifier(
    stack: contextlib.AsyncExitStack,
    auth_address: str,
    cluster_id: str,
    timeout: float = AUTH_WAIT_S,
    *,
    tls: ClientTls | None = None,
) -> TokenVerifier:
    """Fetch this cluster's token keys from auth; the verifier's background refresh stops with the stack.

    ``auth_address`` is auth's service port; ``tls`` the calling service's identity (None: the
    process's own, or plaintext under the development flag).
    """
    verifier = await TokenVerifier.from_auth_service_async(auth_address, cluster_id, timeout=timeout, tls=tls)
    stack.push_async_callback(asyncio.to_thread, verifier.close)
    return verifier


async def service_audit(
    stack: contextlib.AsyncExitStack,
    data_dir: Path,
    *,
    service: str,
    cluster: str,
    seal_interval_s: float = 5.0,
    fsync_each: bool = True,
    signer: str = "",
) -> AuditLog:
    """Open ``<data_dir>/audit.log`` off the event loop; it is sealed and closed when the stack unwinds.

    ``signer``: the service's ``audit_signer`` setting (its seals made by that process, which holds the key).
    """
    return await acquire_in_thread(
        stack,
        lambda: open_service_audit(
            data_dir,
            service=service,
            cluster=cluster,
            seal_interval_s=seal_interval_s,
            fsync_each=fsync_each,
            signer=signer,
        ),
        AuditLog.close,
    )


def grpc_server(
    stack: contextlib.AsyncExitStack,
    service_names: Sequence[str],
    *,
    grace: float,
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    options: Sequence[tuple[str, Any]] = (),
) -> ServiceServer:
    """A Nebula gRPC server whose stop (NOT_SERVING, drain for ``grace`` seconds) runs with the stack."""
    server = create_server(service_names, interceptors=interceptors, options=options)
    stack.push_async_callback(server.stop, grace)
    return server


HANDSHAKE_TIMEOUT_S = 5.0
"""A connection to an internal port that has not finished TLS and HTTP/2 set-up by then is dropped
(gRPC's default is 120 s): the cluster's own services finish in milliseconds."""

MAX_CONNECTIONS = 1024
"""Connections the internal ports hold at once, TLS finished or not; further ones are closed at accept.
A cluster's services, trainers and ranks need a few dozen."""


def internal_server_options() -> list[tuple[str, Any]]:
    """Bounds on unauthenticated connections: how long one may take to finish TLS, how many at once.

    An idle TCP client that never sends a ClientHello is dropped after ``HANDSHAKE_TIMEOUT_S``, so a
    flood of them costs at most ``MAX_CONNECTIONS`` sockets for that long.
    """
    return [
        ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_TIMEOUT_S * 1000)),
        ("grpc.max_allowed_incoming_connections", MAX_CONNECTIONS),
    ]


def bind_internal(
    server: ServiceServer, identity: ServiceIdentity, listen: str, service_listen: str, *, name: str = "grpc"
) -> None:
    """Bind the client port (``name``: TLS, no client certificate) and the service port (mutual TLS).

    In plaintext development mode (``identity.server`` is None) both are plaintext.
    """
    user = identity.credentials(require_client_auth=False)
    mutual = identity.credentials(require_client_auth=True)
    if user is None or mutual is None:
        server.add_insecure_port(name, listen)
        server.add_insecure_port("service", service_listen)
        return
    server.add_secure_port(name, listen, user)
    server.add_secure_port("service", service_listen, mutual)


async def start_internal(
    server: ServiceServer, identity: ServiceIdentity, settings: ServiceSettings, listen: str
) -> dict[str, int | None]:
    """Bind the internal ports and the metrics endpoint, start serving; the ports to announce."""
    bind_internal(server, identity, listen, settings.service_listen)
    if settings.health_listen:
        server.add_health_port(settings.health_listen)
    server.start_metrics(settings.metrics_port, listen, identity.metrics_tls())
    await server.start()
    return {
        "grpc_port": server.ports["grpc"],
        "service_port": server.ports["service"],
        "metrics_port": server.metrics_port,
        "metrics_scheme": server.metrics_scheme,
        **({"health_port": server.ports["health"]} if settings.health_listen else {}),
    }
