"""The ``nebula-codec`` service: the codec servicer on a standard Nebula gRPC server.

Started by ``nebula_common.service.host`` (``python -m services.codec`` or the
``nebula-codec`` console script), which prints exactly one JSON ready line, e.g.
``{"service": "codec", "cluster_id": "a", "grpc_port": 50123, "metrics_port": 9464}``;
with ephemeral ports (the default) that line is how the launcher learns where
the service is. Everything else goes to stderr as JSON logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import torch

from nebula_common.auth.interceptor import TokenAuthInterceptor
from nebula_common.codec.calibration import Calibrator
from nebula_common.proto.nebula.v1 import codec_pb2_grpc
from nebula_common.rpc import ServiceServer
from nebula_common.service.host import ServiceDefinition, Started
from nebula_common.service.identity import service_identity
from nebula_common.service.resources import (
    grpc_server,
    internal_server_options,
    start_internal,
    token_verifier,
)
from services.codec.config import CodecSettings
from services.codec.servicer import CodecServicer

logger = logging.getLogger(__name__)

SERVICE_NAME = "nebula.v1.Codec"
STOP_GRACE_SECONDS = 5.0


async def start_codec(settings: CodecSettings, stack: contextlib.AsyncExitStack) -> Started[ServiceServer]:
    """Verifier, calibration, then the server; each is released in reverse order on stop.

    The host calibration Advise relies on starts here, on a background thread,
    from the cache when one for this host exists. Its thread is stopped and
    joined before the process exits: torch must never be torn down under it.
    """
    torch.set_num_threads(settings.torch_threads)
    identity = await service_identity(stack, settings, "codec")
    verifier = await token_verifier(stack, settings.auth_address, settings.cluster_id, tls=identity.client)
    calibrator = Calibrator(settings.calibration_path())
    stack.push_async_callback(asyncio.to_thread, calibrator.close)
    if settings.calibrate_at_start:
        calibrator.start()  # in the background: health reports SERVING at once, Advise waits for it
    server = grpc_server(
        stack,
        [SERVICE_NAME],
        grace=STOP_GRACE_SECONDS,
        interceptors=[*identity.interceptors(), TokenAuthInterceptor("codec", verifier)],
        options=internal_server_options(),
    )
    servicer = CodecServicer(calibrator=calibrator, max_tensor_bytes=settings.max_tensor_bytes)
    codec_pb2_grpc.add_CodecServicer_to_server(servicer, server.server)
    ports = await start_internal(server, identity, settings, settings.listen)
    logger.info("codec service started", extra={"fields": {"cluster_id": settings.cluster_id, **ports}})
    return Started(server, ports)


SERVICE = ServiceDefinition("codec", CodecSettings, start_codec)
