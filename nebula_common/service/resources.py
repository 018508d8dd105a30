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
from nebula_common.service.host import acquire_in_thread

AUTH_WAIT_S = 30.0
"""How long a service waits for its cluster's auth service at start-up (they often start together)."""


async def token_verifier(
    stack: contextlib.AsyncExitStack, auth_address: str, cluster_id: str, timeout: float = AUTH_WAIT_S
) -> TokenVerifier:
    """Fetch this cluster's token keys from auth; the verifier's background refresh stops with the stack."""
    verifier = await TokenVerifier.from_auth_service_async(auth_address, cluster_id, timeout=timeout)
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
) -> AuditLog:
    """Open ``<data_dir>/audit.log`` off the event loop; it is sealed and closed when the stack unwinds."""
    return await acquire_in_thread(
        stack,
        lambda: open_service_audit(
            data_dir, service=service, cluster=cluster, seal_interval_s=seal_interval_s, fsync_each=fsync_each
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


async def start_internal(server: ServiceServer, listen: str, metrics_port: int) -> dict[str, int | None]:
    """Bind the cluster-internal port and the metrics endpoint, start serving; the ports to announce."""
    server.add_insecure_port("grpc", listen)
    server.start_metrics(metrics_port, listen)
    await server.start()
    return {"grpc_port": server.ports["grpc"], "metrics_port": server.metrics_port}
