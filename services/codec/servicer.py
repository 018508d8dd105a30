"""gRPC face of the codec library: translate messages, run the library off the event loop, count.

All compression logic and validation lives in ``nebula_common.codec``; this layer
only maps ``RawTensor`` and headers to and from it, turns ``CodecError`` into
INVALID_ARGUMENT with the library's message (which names the bad field), and
records Prometheus metrics. ``EncodeStream``/``DecodeStream`` carry tensors of any
size in chunks (unary calls are bounded by the gRPC message limit); ``Advise``
ranks specs using the host calibration the server started at boot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import NoReturn

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from nebula_common.codec import (
    CodecError,
    FrameAssembler,
    WireFormatError,
    available_codecs,
    decode_tensor,
    encode_tensor,
    get_codec,
    to_frames,
)
from nebula_common.codec.advice import advise
from nebula_common.codec.advice_proto import request_from_proto, result_to_proto
from nebula_common.codec.base import element_size, numel
from nebula_common.codec.calibration import Calibrator
from nebula_common.codec.raw_tensor import raw_to_tensor, tensor_to_raw
from nebula_common.codec.wire_frames import DEFAULT_CHUNK_SIZE
from nebula_common.codec.wire_header import validate_dtype, validate_shape
from nebula_common.proto.nebula.v1 import codec_pb2, codec_pb2_grpc, tensor_pb2

DEFAULT_MAX_TENSOR_BYTES = 1 << 30
"""Largest raw tensor one streaming call may carry (the service buffers one tensor at a time)."""
CALIBRATION_WAIT_SECONDS = 300.0

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


def _wire_codec(spec: str) -> str:
    codec = get_codec(spec)
    if not codec.wire:
        raise CodecError(
            f"codec: {codec.spec!r} configures a trainer stream (error feedback, delta, warm-up or auto) "
            "and has no byte format; encode with its inner wire codec"
        )
    return codec.spec


def _encode(request: codec_pb2.EncodeRequest) -> codec_pb2.EncodeResponse:
    _wire_codec(request.codec)  # validate the spec first so a bad spec is reported as such
    tensor = raw_to_tensor(request.tensor.dtype, request.tensor.shape, request.tensor.data)
    encoded = encode_tensor(tensor, request.codec)
    return codec_pb2.EncodeResponse(header=encoded.header, payload=encoded.payload)


def _decode(request: codec_pb2.DecodeRequest) -> codec_pb2.DecodeResponse:
    tensor = decode_tensor(request.header, request.payload)
    dtype, shape, data = tensor_to_raw(tensor)
    return codec_pb2.DecodeResponse(tensor=codec_pb2.RawTensor(dtype=dtype, shape=shape, data=data))


@dataclass
class _PendingTensor:
    """An EncodeStream tensor whose raw bytes are still arriving."""

    codec: str
    dtype: str
    shape: tuple[int, ...]
    expected: int
    parts: list[bytes]
    received: int = 0


class CodecServicer(codec_pb2_grpc.CodecServicer):
    """Encode/Decode/streams/Advise/ListCodecs for grpc.aio; CPU-heavy work runs in a worker thread."""

    def __init__(
        self,
        metrics: CodecMetrics | None = None,
        calibrator: Calibrator | None = None,
        max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
    ) -> None:
        self._metrics = metrics if metrics is not None else default_metrics()
        self._calibrator = calibrator
        self._max_tensor_bytes = max_tensor_bytes

    async def EncodeStream(
        self,
        request_iterator: AsyncIterator[codec_pb2.EncodeStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[tensor_pb2.TensorFrame]:
        frame_id = 0
        pending: _PendingTensor | None = None
        async for message in request_iterator:
            started = time.perf_counter()
            part = message.WhichOneof("part")
            try:
                if part == "start":
                    if pending is not None:
                        raise CodecError(
                            f"start: a new tensor started after {pending.received} of {pending.expected} "
                            "bytes of the previous one"
                        )
                    pending = self._start_tensor(message.start)
                elif part == "data":
                    if pending is None:
                        raise CodecError("data: raw bytes arrived before a start message")
                    pending.received += len(message.data)
                    if pending.received > pending.expected:
                        raise CodecError(
                            f"data: {pending.received} bytes received but shape {list(pending.shape)} of "
                            f"{pending.dtype} is {pending.expected}"
                        )
                    pending.parts.append(message.data)
                else:
                    raise CodecError("message carries neither start nor data")
            except CodecError as exc:
                await self._fail(
                    context, "EncodeStream", _codec_label(pending.codec if pending else ""), started, exc
                )
            if pending is None or pending.received < pending.expected:
                continue
            done, pending = pending, None
            frame_id += 1
            self._metrics.bytes_in.labels("EncodeStream").inc(done.expected)
            try:
                tensor = raw_to_tensor(done.dtype, done.shape, b"".join(done.parts))
                encoded = await asyncio.to_thread(encode_tensor, tensor, done.codec, frame_id=frame_id)
            except CodecError as exc:
                await self._fail(context, "EncodeStream", done.codec, started, exc)
            except Exception as exc:
                await self._crash(context, "EncodeStream", done.codec, started, exc)
            self._metrics.bytes_out.labels("EncodeStream").inc(len(encoded.payload))
            for frame in to_frames(encoded):
                yield frame
            self._record("EncodeStream", done.codec, "ok", started)
        if pending is not None:
            await self._fail(
                context,
                "EncodeStream",
                pending.codec,
                time.perf_counter(),
                CodecError(
                    f"data: stream ended after {pending.received} of {pending.expected} bytes of a tensor"
                ),
            )

    def _start_tensor(self, start: codec_pb2.EncodeStart) -> _PendingTensor:
        codec = _wire_codec(start.codec)
        dtype = validate_dtype(start.dtype, "start.dtype")
        shape = validate_shape(start.shape, "start.shape")
        expected = numel(shape) * element_size(dtype)
        if expected > self._max_tensor_bytes:
            raise CodecError(
                f"start.shape: {list(shape)} of {start.dtype} is {expected} bytes, more than the "
                f"{self._max_tensor_bytes} this service accepts per tensor"
            )
        return _PendingTensor(codec=codec, dtype=start.dtype, shape=shape, expected=expected, parts=[])

    async def DecodeStream(
        self, request_iterator: AsyncIterator[tensor_pb2.TensorFrame], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[codec_pb2.RawTensorPart]:
        assembler = FrameAssembler()
        async for frame in request_iterator:
            started = time.perf_counter()
            label = _codec_label(frame.header.codec) if frame.HasField("header") else ""
            try:
                if frame.HasField("header") and frame.header.payload_size > self._max_tensor_bytes:
                    raise WireFormatError(
                        f"payload_size: {frame.header.payload_size} bytes exceeds the "
                        f"{self._max_tensor_bytes} this service accepts per tensor"
                    )
                encoded = assembler.feed(frame)
            except CodecError as exc:
                await self._fail(context, "DecodeStream", label, started, exc)
            if encoded is None:
                continue
            label = _codec_label(encoded.header.codec)
            self._metrics.bytes_in.labels("DecodeStream").inc(len(encoded.payload))
            try:
                tensor = await asyncio.to_thread(decode_tensor, encoded.header, encoded.payload)
                dtype, shape, data = tensor_to_raw(tensor)
            except CodecError as exc:
                await self._fail(context, "DecodeStream", label, started, exc)
            except Exception as exc:
                await self._crash(context, "DecodeStream", label, started, exc)
            info = codec_pb2.RawTensorInfo(
                dtype=dtype, shape=shape, size=len(data), frame_id=encoded.header.frame_id
            )
            yield codec_pb2.RawTensorPart(info=info)
            view = memoryview(data)
            for offset in range(0, len(data), DEFAULT_CHUNK_SIZE):
                yield codec_pb2.RawTensorPart(data=bytes(view[offset : offset + DEFAULT_CHUNK_SIZE]))
            self._metrics.bytes_out.labels("DecodeStream").inc(len(data))
            self._record("DecodeStream", label, "ok", started)
        if assembler.in_progress:
            await self._fail(
                context,
                "DecodeStream",
                "",
                time.perf_counter(),
                WireFormatError("frame: stream ended in the middle of a frame (chunks missing)"),
            )

    async def Advise(
        self, request: codec_pb2.AdviseRequest, context: grpc.aio.ServicerContext
    ) -> codec_pb2.AdviseResponse:
        started = time.perf_counter()
        if self._calibrator is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "Advise: this server runs without a calibration")
        calibrator = self._calibrator
        try:
            advice_request = request_from_proto(request)
            advice_request.validate()
            await asyncio.to_thread(calibrator.get, CALIBRATION_WAIT_SECONDS)
            result = await asyncio.to_thread(advise, advice_request, calibrator)
        except CodecError as exc:
            await self._fail(context, "Advise", "", started, exc)
        except TimeoutError:
            self._record("Advise", "", "unavailable", started)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "Advise: host calibration still running; retry")
        except Exception as exc:
            await self._crash(context, "Advise", "", started, exc)
        self._record("Advise", "", "ok", started)
        return result_to_proto(result)

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
