"""One place that builds a gRPC server the Nebula way.

Every service gets the same things without repeating them: the standard
``grpc.health.v1`` service (so Kubernetes and compose can probe it), server
reflection (so ``grpcurl`` works during an incident), generous message limits
for tensor payloads, and a graceful stop that drains in-flight calls.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from nebula_common.metrics import MetricsEndpoint, start_metrics_endpoint
from nebula_common.pki.mutual_tls import MutualTls

GRPC_MESSAGE_LIMIT = 64 * 1024 * 1024
"""Largest single gRPC message we accept; tensor payloads are chunked well below it."""

_SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", GRPC_MESSAGE_LIMIT),
    ("grpc.max_send_message_length", GRPC_MESSAGE_LIMIT),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_time_ms", 20_000),
    # gRPC enables SO_REUSEPORT by default, which lets a second server silently share a fixed port.
    ("grpc.so_reuseport", 0),
]


@dataclass
class ServiceServer:
    """A started-or-startable aio server plus the health servicer that reports its state."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    service_names: list[str]
    ports: dict[str, int] = field(default_factory=dict)
    metrics: MetricsEndpoint | None = None
    probe_server: grpc.aio.Server | None = None
    states: dict[str, bool] = field(default_factory=dict)
    """Services whose health follows a state of their own (``follow``): name -> serving now."""
    _started: bool = False
    _publishing: set[asyncio.Task[None]] = field(default_factory=set)

    def follow(self, name: str, watch: Callable[[Callable[[bool], None]], None]) -> None:
        """Report ``name``'s health from a state: ``watch(listener)`` calls ``listener(ok)`` now and on
        every change, from any thread. NOT_SERVING while not ok, e.g. the audit API while its log
        cannot be written (a full disk): probes and ``nebula local status`` see it, the server runs on.
        """
        loop = asyncio.get_running_loop()

        def changed(ok: bool) -> None:
            self.states[name] = ok

            def publish() -> None:
                if self._started:
                    task = loop.create_task(self.health.set(name, _status(ok)))
                    self._publishing.add(task)
                    task.add_done_callback(self._publishing.discard)

            loop.call_soon_threadsafe(publish)

        watch(changed)

    def add_insecure_port(self, name: str, address: str) -> int:
        """Bind a plaintext port (cluster-internal listeners only) and remember it under ``name``."""
        port = self.server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"could not bind {name} port on {address}")
        self.ports[name] = port
        return port

    def add_secure_port(self, name: str, address: str, credentials: grpc.ServerCredentials) -> int:
        """Bind a TLS port (the WAN listener) and remember it under ``name``."""
        port = self.server.add_secure_port(address, credentials)
        if port == 0:
            raise OSError(f"could not bind {name} port on {address}")
        self.ports[name] = port
        return port

    def add_health_port(self, address: str) -> int:
        """A plaintext listener that serves ``grpc.health.v1`` only, for probes that cannot speak TLS.

        Kubernetes' native gRPC probes are plaintext; the service's own ports are TLS. This separate
        server shares the health servicer (so it reports the same state) and serves nothing else:
        liveness and service names are all it reveals, as health and reflection do on any port.
        """
        probe = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, probe)
        port = probe.add_insecure_port(address)
        if port == 0:
            raise OSError(f"could not bind health port on {address}")
        self.probe_server = probe
        self.ports["health"] = port
        return port

    def start_metrics(self, port: int, listen: str, tls: MutualTls | None = None) -> int | None:
        """Serve Prometheus metrics next to this server (see ``start_metrics_endpoint``)."""
        self.metrics = start_metrics_endpoint(port, listen, tls)
        if self.metrics is None:
            return None
        self.ports["metrics"] = self.metrics.port
        return self.metrics.port

    @property
    def metrics_port(self) -> int | None:
        return self.metrics.port if self.metrics is not None else None

    @property
    def metrics_scheme(self) -> str | None:
        """``https`` (readers need a monitoring identity), ``http`` (plaintext development), or None."""
        return self.metrics.scheme if self.metrics is not None else None

    async def start(self) -> None:
        await self.server.start()
        if self.probe_server is not None:
            await self.probe_server.start()
        for name in ("", *self.service_names):
            await self.health.set(name, _status(self.states.get(name, True)))
        self._started = True

    async def stop(self, grace: float = 2.0) -> None:
        """Report NOT_SERVING first so probes stop routing here, then drain calls."""
        self._started = False
        for name in ("", *self.service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace)
        if self.probe_server is not None:
            await self.probe_server.stop(0)
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.stop)
            self.metrics = None


def _status(ok: bool) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType:
    return health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING


def create_server(
    service_names: Sequence[str],
    *,
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    options: Sequence[tuple[str, Any]] = (),
) -> ServiceServer:
    """Create an aio server with health and reflection registered for ``service_names``.

    ``service_names`` are full proto names (``nebula.v1.Relay``); register the
    servicers themselves on ``.server`` before calling ``start``.
    """
    merged = dict(_SERVER_OPTIONS)
    merged.update(options)  # caller's options win (e.g. the WAN keepalive policy)
    server = grpc.aio.server(options=list(merged.items()), interceptors=list(interceptors))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection(
        [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    return ServiceServer(server=server, health=health_servicer, service_names=names)
