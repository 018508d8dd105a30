"""Ask a cluster's codec service which codec specs to use for a job (``codec: auto``).

The SDK resolves ``auto`` once, at submission, before any stage starts
(``nebula_common.sdk.codec_advice.resolve_auto_codecs``, called by ``submit_job``):
it asks the source cluster's codec service and writes the answer into both stage
specs, because two services calibrated on two hosts could disagree and a decoder
refuses frames of another codec. A trainer refuses a stage whose codec is still
``auto`` (``services/trainer/validation.py``). The call it makes::

    request = job_advice_request(
        bandwidth_bps=60e6, rtt_seconds=0.04, edge="encoder->decoder",
        activation_shape=(64, 12, 128), micro_batches=2, compute_seconds=0.05,
    )
    result = advise_specs_sync("127.0.0.1:7401", request, token=token)
    forward, backward = result.forward_spec, result.backward_spec

The service calibrates its host at start-up, so the first call after a cold
start may wait for that (seconds); later calls answer in well under a second
for typical shapes. Errors: ``CodecError`` for an invalid request (the service's
message names the field), ``AdviceUnavailableError`` when the service cannot be
reached or is still calibrating past ``timeout``.
"""

from __future__ import annotations

import grpc

from nebula_common.codec.advice import (
    AdviceRequest,
    AdviceResult,
    EdgeTensor,
    job_advice_request,
)
from nebula_common.codec.advice_proto import request_to_proto, result_from_proto
from nebula_common.codec.base import CodecError
from nebula_common.proto.nebula.v1 import codec_pb2_grpc
from nebula_common.rpc import bearer_metadata
from nebula_common.rpc.internal_tls import internal_channel

__all__ = [
    "AdviceRequest",
    "AdviceResult",
    "AdviceUnavailableError",
    "EdgeTensor",
    "advise_specs",
    "advise_specs_sync",
    "job_advice_request",
]


class AdviceUnavailableError(RuntimeError):
    """The codec service could not answer (unreachable, calibrating past the timeout, internal error)."""


def _translate(exc: grpc.RpcError, address: str) -> Exception:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return CodecError(f"codec service rejected the advice request: {details}")
    return AdviceUnavailableError(
        f"codec service at {address} could not advise: {getattr(code, 'name', code)}: {details}"
    )


async def advise_specs(
    codec_address: str, request: AdviceRequest, *, token: str | None = None, timeout: float = 300.0
) -> AdviceResult:
    """Call ``Codec.Advise`` on ``codec_address`` (host:port) from asyncio code."""
    message = request_to_proto(request)
    metadata = bearer_metadata(token) if token else None
    async with internal_channel(codec_address, service="codec", aio=True) as channel:
        stub = codec_pb2_grpc.CodecStub(channel)
        try:
            response = await stub.Advise(message, timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            raise _translate(exc, codec_address) from None
    return result_from_proto(response)


def advise_specs_sync(
    codec_address: str, request: AdviceRequest, *, token: str | None = None, timeout: float = 300.0
) -> AdviceResult:
    """Blocking variant of ``advise_specs`` for threads that run training (no event loop needed)."""
    message = request_to_proto(request)
    metadata = bearer_metadata(token) if token else None
    channel = internal_channel(codec_address, service="codec")
    try:
        stub = codec_pb2_grpc.CodecStub(channel)
        response = stub.Advise(message, timeout=timeout, metadata=metadata)
    except grpc.RpcError as exc:
        raise _translate(exc, codec_address) from None
    finally:
        channel.close()
    return result_from_proto(response)
