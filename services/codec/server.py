"""The ``nebula-codec`` process: the codec servicer on a standard Nebula gRPC server.

On startup it prints exactly one JSON line to stdout, e.g.
``{"service": "codec", "grpc_port": 50123, "metrics_port": 9464}``: with
ephemeral ports (the default) that line is how the launcher learns where the
service is. Everything else goes to stderr as JSON logs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from dataclasses import dataclass
from threading import Thread
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server
from pydantic import ValidationError

from nebula_common.logging import configure_logging
from nebula_common.proto.nebula.v1 import codec_pb2_grpc
from nebula_common.rpc import ServiceServer, create_server
from services.codec.config import CodecSettings
from services.codec.servicer import CodecServicer

logger = logging.getLogger(__name__)

SERVICE_NAME = "nebula.v1.Codec"
STOP_GRACE_SECONDS = 5.0


@dataclass
class CodecServer(ServiceServer):
    """A ServiceServer that also owns the Prometheus HTTP endpoint, so stopping one stops both."""

    metrics_http: WSGIServer | None = None
    metrics_thread: Thread | None = None

    async def stop(self, grace: float = 2.0) -> None:
        await super().stop(grace)
        if self.metrics_http is not None:
            await asyncio.to_thread(self.metrics_http.shutdown)
            self.metrics_http.server_close()
            self.metrics_http = None


async def run_codec_server(settings: CodecSettings) -> CodecServer:
    """Build, bind and start the codec service; ports end up in ``.ports`` ("grpc", "metrics")."""
    base = create_server([SERVICE_NAME])
    server = CodecServer(
        server=base.server, health=base.health, service_names=base.service_names, ports=base.ports
    )
    codec_pb2_grpc.add_CodecServicer_to_server(CodecServicer(), server.server)
    try:
        server.add_insecure_port("grpc", settings.listen)
        if settings.metrics_enabled:
            http_server, thread = start_http_server(settings.metrics_port, addr=settings.listen_host)
            server.metrics_http, server.metrics_thread = http_server, thread
            server.ports["metrics"] = http_server.server_port
        await server.start()
    except BaseException:
        # Do not leak a bound port or a metrics thread when startup fails half-way.
        await server.stop(0)
        raise
    logger.info(
        "codec service started",
        extra={"fields": {"cluster_id": settings.cluster_id, "ports": dict(server.ports)}},
    )
    return server


async def _serve(settings: CodecSettings) -> None:
    server = await run_codec_server(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    announcement = {
        "service": "codec",
        "grpc_port": server.ports["grpc"],
        "metrics_port": server.ports.get("metrics"),
    }
    sys.stdout.write(json.dumps(announcement) + "\n")
    sys.stdout.flush()
    try:
        await stop.wait()
        logger.info("stopping codec service")
    finally:
        await server.stop(STOP_GRACE_SECONDS)
    logger.info("codec service stopped")


def main() -> int:
    """Console entry point ``nebula-codec``; returns the process exit code."""
    try:
        settings = CodecSettings()
    except ValidationError as exc:
        configure_logging("codec")
        logger.error("invalid NEBULA_CODEC_* settings: %s", exc)
        return 2
    configure_logging("codec", settings.log_level)
    try:
        asyncio.run(_serve(settings))
    except (OSError, RuntimeError) as exc:
        # Typically the listen or metrics address is taken or invalid: say so, no traceback.
        logger.error("codec service could not start: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
