"""gRPC face of the codec library: translate messages, run the library off the event loop, count.

All compression logic and validation lives in ``nebula_common.codec``; this layer
only maps ``RawTensor`` and headers to and from it, turns ``CodecError`` into
INVALID_ARGUMENT with the library's message (which names the bad field), and
records Prometheus metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import NoReturn

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from nebula_common.codec import CodecError, available_codecs, decode_tensor, encode_tensor, get_codec
from nebula_common.codec.wire import raw_to_tensor, tensor_to_raw
from nebula_common.proto.nebula.v1 import codec_pb2, codec_pb2_grpc

logger = logging.getLogger(__name__)

INVALID_CODEC_LABEL = "invalid"
"""Metric label for requests whose spec does not parse: raw client strings would explode cardinality."""

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class CodecMetrics:
    """The service's Prometheus instruments, bound to one registry."""

    requests: Counter
    bytes_in: Counter
    bytes_out: Counter
    seconds: Histogram

    @classmethod
    def create(cls, registry: CollectorRegistry = REGISTRY) -> CodecMetrics:
        return cls(
            requests=Counter(
                "nebula_codec_requests_total",
                "Codec RPCs by method, canonical codec spec and outcome.",
                ["method", "codec", "outcome"],
                registry=registry,
            ),
            bytes_in=Counter(
                "nebula_codec_bytes_in_total",
                "Tensor bytes received: raw data for Encode, encoded payload for Decode.",
                ["method"],
                registry=registry,
            ),
            bytes_out=Counter(
                "nebula_codec_bytes_out_total",
                "Tensor bytes returned by successful calls: payload for Encode, raw data for Decode.",
                ["method"],
                registry=registry,
            ),
            seconds=Histogram(
                "nebula_codec_seconds",
                "Time to serve a codec RPC, including validation.",
                ["method"],
                buckets=_LATENCY_BUCKETS,
                registry=registry,
            ),
        )


_default_metrics: CodecMetrics | None = None


def default_metrics() -> CodecMetrics:
    """Metrics on the global registry, created once: registering the same names twice is an error."""
    global _default_metrics
    if _default_metrics is None:
        _default_metrics = CodecMetrics.create()
    return _default_metrics


def _codec_label(spec: str) -> str:
    try:
        return get_codec(spec).spec
    except CodecError:
        return INVALID_CODEC_LABEL


def _encode(request: codec_pb2.EncodeRequest) -> codec_pb2.EncodeResponse:
    get_codec(request.codec)  # validate the spec first so a bad spec is reported as such
    tensor = raw_to_tensor(request.tensor.dtype, request.tensor.shape, request.tensor.data)
    encoded = encode_tensor(tensor, request.codec)
    return codec_pb2.EncodeResponse(header=encoded.header, payload=encoded.payload)


def _decode(request: codec_pb2.DecodeRequest) -> codec_pb2.DecodeResponse:
    tensor = decode_tensor(request.header, request.payload)
    dtype, shape, data = tensor_to_raw(tensor)
    return codec_pb2.DecodeResponse(tensor=codec_pb2.RawTensor(dtype=dtype, shape=shape, data=data))


class CodecServicer(codec_pb2_grpc.CodecServicer):
    """Encode/Decode/ListCodecs for grpc.aio; CPU-heavy work runs in a worker thread."""

    def __init__(self, metrics: CodecMetrics | None = None) -> None:
        self._metrics = metrics if metrics is not None else default_metrics()

    async def Encode(
        self, request: codec_pb2.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> codec_pb2.EncodeResponse:
        started = time.perf_counter()
        self._metrics.bytes_in.labels("Encode").inc(len(request.tensor.data))
        label = _codec_label(request.codec)
        try:
            # Off the event loop: a large tensor takes tens of milliseconds, which would
            # stall every other call (including health checks) on this server.
            response = await asyncio.to_thread(_encode, request)
        except CodecError as exc:
            await self._fail(context, "Encode", label, started, exc)
        except Exception as exc:
            await self._crash(context, "Encode", label, started, exc)
        self._metrics.bytes_out.labels("Encode").inc(len(response.payload))
        self._record("Encode", label, "ok", started)
        return response

    async def Decode(
        self, request: codec_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> codec_pb2.DecodeResponse:
        started = time.perf_counter()
        self._metrics.bytes_in.labels("Decode").inc(len(request.payload))
        label = _codec_label(request.header.codec)
        try:
            response = await asyncio.to_thread(_decode, request)
        except CodecError as exc:
            await self._fail(context, "Decode", label, started, exc)
        except Exception as exc:
            await self._crash(context, "Decode", label, started, exc)
        self._metrics.bytes_out.labels("Decode").inc(len(response.tensor.data))
        self._record("Decode", label, "ok", started)
        return response

    async def ListCodecs(
        self, request: codec_pb2.ListCodecsRequest, context: grpc.aio.ServicerContext
    ) -> codec_pb2.ListCodecsResponse:
        started = time.perf_counter()
        response = codec_pb2.ListCodecsResponse(codecs=available_codecs())
        self._record("ListCodecs", "", "ok", started)
        return response

    def _record(self, method: str, codec: str, outcome: str, started: float) -> None:
        self._metrics.requests.labels(method, codec, outcome).inc()
        self._metrics.seconds.labels(method).observe(time.perf_counter() - started)

    async def _fail(
        self, context: grpc.aio.ServicerContext, method: str, codec: str, started: float, exc: CodecError
    ) -> NoReturn:
        self._record(method, codec, "invalid_argument", started)
        logger.debug("rejected %s request: %s", method, exc, extra={"fields": {"method": method}})
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        raise AssertionError("unreachable: context.abort raises")  # pragma: no cover

    async def _crash(
        self, context: grpc.aio.ServicerContext, method: str, codec: str, started: float, exc: Exception
    ) -> NoReturn:
        self._record(method, codec, "error", started)
        logger.error("%s failed", method, exc_info=exc, extra={"fields": {"method": method, "codec": codec}})
        await context.abort(grpc.StatusCode.INTERNAL, f"{method} failed: internal error")
        raise AssertionError("unreachable: context.abort raises")  # pragma: no cover
