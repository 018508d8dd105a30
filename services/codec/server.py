"""The ``nebula-codec`` process: the codec servicer on a standard Nebula gRPC server.

On startup it prints exactly one JSON line to stdout, e.g.
``{"service": "codec", "grpc_port": 50123, "metrics_port": 9464}``: with
ephemeral ports (the default) that line is how the launcher learns where the
service is. Everything else goes to stderr as JSON logs.
"""

from __future__ import annotations

import asyncio
import logging
import sys

import torch
from pydantic import ValidationError

from nebula_common.codec.calibration import Calibrator
from nebula_common.logging import configure_logging
from nebula_common.proto.nebula.v1 import codec_pb2_grpc
from nebula_common.rpc import ServiceServer, create_server
from nebula_common.rpc.lifecycle import serve_until_signalled
from services.codec.config import CodecSettings
from services.codec.servicer import CodecServicer

logger = logging.getLogger(__name__)

SERVICE_NAME = "nebula.v1.Codec"
STOP_GRACE_SECONDS = 5.0


async def run_codec_server(settings: CodecSettings) -> ServiceServer:
    """Build, bind and start the codec service; ports end up in ``.ports`` ("grpc", "metrics").

    The host calibration Advise relies on starts here, on a background thread, from
    the cache when one for this host exists.
    """
    torch.set_num_threads(settings.torch_threads)
    calibrator = Calibrator(settings.calibration_path())
    if settings.calibrate_at_start:
        calibrator.start()  # in the background: health reports SERVING at once, Advise waits for it
    server = create_server([SERVICE_NAME])
    servicer = CodecServicer(calibrator=calibrator, max_tensor_bytes=settings.max_tensor_bytes)
    codec_pb2_grpc.add_CodecServicer_to_server(servicer, server.server)
    try:
        server.add_insecure_port("grpc", settings.listen)
        server.start_metrics(settings.metrics_port, settings.listen)
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
    ready = {"service": "codec", "grpc_port": server.ports["grpc"], "metrics_port": server.metrics_port}
    await serve_until_signalled(ready, lambda: server.stop(STOP_GRACE_SECONDS))


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
