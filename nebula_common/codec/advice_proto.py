"""Codec advice on the wire: ``AdviceRequest``/``AdviceResult`` to and from ``nebula.v1`` messages.

Shared by the codec service and its client, so both ends read a request the same way: a direction
the request does not name is refused, not guessed, and a sample tensor travels as raw bytes with its
dtype and shape.
"""

from __future__ import annotations

from nebula_common.codec.advice import (
    BACKWARD,
    DEFAULT_TOP_N,
    FORWARD,
    AdviceRequest,
    AdviceResult,
    DirectionAdvice,
    EdgeTensor,
    Option,
)
from nebula_common.codec.base import CodecError
from nebula_common.codec.raw_tensor import raw_to_tensor, tensor_to_raw
from nebula_common.proto.nebula.v1 import codec_pb2, tensor_pb2

_DIRECTIONS = {FORWARD: tensor_pb2.DIRECTION_FORWARD, BACKWARD: tensor_pb2.DIRECTION_BACKWARD}
_DIRECTION_NAMES = {value: key for key, value in _DIRECTIONS.items()}


def request_to_proto(request: AdviceRequest) -> codec_pb2.AdviseRequest:
    message = codec_pb2.AdviseRequest(
        bandwidth_bps=request.bandwidth_bps,
        rtt_seconds=request.rtt_seconds,
        compute_seconds=request.compute_seconds,
        error_budget=request.error_budget,
        candidates=request.candidates,
        top_n=request.top_n,
    )
    for tensor in request.tensors:
        if tensor.direction not in _DIRECTIONS:
            raise CodecError(f"tensors: direction must be forward or backward, got {tensor.direction!r}")
        item = message.tensors.add(
            edge=tensor.edge,
            direction=_DIRECTIONS[tensor.direction],
            dtype=tensor.dtype,
            shape=list(tensor.shape),
            per_step=tensor.per_step,
        )
        if tensor.sample is not None:
            dtype, shape, data = tensor_to_raw(tensor.sample)
            item.sample.CopyFrom(codec_pb2.RawTensor(dtype=dtype, shape=shape, data=data))
    return message


def request_from_proto(message: codec_pb2.AdviseRequest) -> AdviceRequest:
    tensors = []
    for item in message.tensors:
        direction = _DIRECTION_NAMES.get(item.direction)
        if direction is None:
            raise CodecError(f"tensors: edge {item.edge!r} has no direction (forward or backward)")
        sample = None
        if item.HasField("sample"):
            sample = raw_to_tensor(item.sample.dtype, item.sample.shape, item.sample.data)
        tensors.append(
            EdgeTensor(
                edge=item.edge,
                direction=direction,
                shape=tuple(int(dim) for dim in item.shape),
                dtype=item.dtype or "float32",
                per_step=item.per_step or 1,
                sample=sample,
            )
        )
    return AdviceRequest(
        bandwidth_bps=message.bandwidth_bps,
        rtt_seconds=message.rtt_seconds,
        tensors=tensors,
        compute_seconds=message.compute_seconds,
        error_budget=message.error_budget,
        candidates=list(message.candidates),
        top_n=message.top_n or DEFAULT_TOP_N,
    )


def result_to_proto(result: AdviceResult) -> codec_pb2.AdviseResponse:
    message = codec_pb2.AdviseResponse(
        predicted_step_seconds=result.predicted_step_seconds,
        baseline_step_seconds=result.baseline_step_seconds,
        calibration_host=result.calibration_host,
        calibrated_at=result.calibrated_at,
        calibration_cached=result.calibration_cached,
    )
    for advice in result.directions:
        entry = message.directions.add(
            edge=advice.edge,
            direction=_DIRECTIONS[advice.direction],
            shape=list(advice.shape),
            error_source=advice.error_source,
            error_budget=advice.error_budget,
            baseline_seconds=advice.baseline_seconds,
        )
        for option in advice.options:
            entry.options.add(**option.__dict__)
    return message


def result_from_proto(message: codec_pb2.AdviseResponse) -> AdviceResult:
    directions = []
    for entry in message.directions:
        options = [
            Option(
                spec=o.spec,
                ratio=o.ratio,
                encoded_bytes=o.encoded_bytes,
                rel_error=o.rel_error,
                encode_seconds=o.encode_seconds,
                decode_seconds=o.decode_seconds,
                transfer_seconds=o.transfer_seconds,
                direction_seconds=o.direction_seconds,
                within_budget=o.within_budget,
                note=o.note,
            )
            for o in entry.options
        ]
        directions.append(
            DirectionAdvice(
                edge=entry.edge,
                direction=_DIRECTION_NAMES.get(entry.direction, "unspecified"),
                shape=tuple(entry.shape),
                options=options,
                error_source=entry.error_source,
                error_budget=entry.error_budget,
                baseline_seconds=entry.baseline_seconds,
            )
        )
    return AdviceResult(
        directions=directions,
        predicted_step_seconds=message.predicted_step_seconds,
        baseline_step_seconds=message.baseline_step_seconds,
        calibration_host=message.calibration_host,
        calibrated_at=message.calibrated_at,
        calibration_cached=message.calibration_cached,
    )
