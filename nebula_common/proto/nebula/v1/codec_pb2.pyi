from nebula_common.proto.nebula.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RawTensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("codec", "tensor")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    codec: str
    tensor: RawTensor
    def __init__(self, codec: _Optional[str] = ..., tensor: _Optional[_Union[RawTensor, _Mapping]] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("header", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: _tensor_pb2.TensorHeader
    payload: bytes
    def __init__(self, header: _Optional[_Union[_tensor_pb2.TensorHeader, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("header", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: _tensor_pb2.TensorHeader
    payload: bytes
    def __init__(self, header: _Optional[_Union[_tensor_pb2.TensorHeader, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("tensor",)
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    tensor: RawTensor
    def __init__(self, tensor: _Optional[_Union[RawTensor, _Mapping]] = ...) -> None: ...

class ListCodecsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListCodecsResponse(_message.Message):
    __slots__ = ("codecs",)
    CODECS_FIELD_NUMBER: _ClassVar[int]
    codecs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, codecs: _Optional[_Iterable[str]] = ...) -> None: ...

class EncodeStart(_message.Message):
    __slots__ = ("codec", "dtype", "shape")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    codec: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, codec: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class EncodeStreamRequest(_message.Message):
    __slots__ = ("start", "data")
    START_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    start: EncodeStart
    data: bytes
    def __init__(self, start: _Optional[_Union[EncodeStart, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class RawTensorInfo(_message.Message):
    __slots__ = ("dtype", "shape", "size", "frame_id")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    FRAME_ID_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    size: int
    frame_id: int
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., size: _Optional[int] = ..., frame_id: _Optional[int] = ...) -> None: ...

class RawTensorPart(_message.Message):
    __slots__ = ("info", "data")
    INFO_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    info: RawTensorInfo
    data: bytes
    def __init__(self, info: _Optional[_Union[RawTensorInfo, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class EdgeTensor(_message.Message):
    __slots__ = ("edge", "direction", "dtype", "shape", "per_step", "sample")
    EDGE_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PER_STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    edge: str
    direction: _tensor_pb2.Direction
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    per_step: int
    sample: RawTensor
    def __init__(self, edge: _Optional[str] = ..., direction: _Optional[_Union[_tensor_pb2.Direction, str]] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., per_step: _Optional[int] = ..., sample: _Optional[_Union[RawTensor, _Mapping]] = ...) -> None: ...

class AdviseRequest(_message.Message):
    __slots__ = ("bandwidth_bps", "rtt_seconds", "tensors", "compute_seconds", "error_budget", "candidates", "top_n")
    BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    RTT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_BUDGET_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    bandwidth_bps: float
    rtt_seconds: float
    tensors: _containers.RepeatedCompositeFieldContainer[EdgeTensor]
    compute_seconds: float
    error_budget: float
    candidates: _containers.RepeatedScalarFieldContainer[str]
    top_n: int
    def __init__(self, bandwidth_bps: _Optional[float] = ..., rtt_seconds: _Optional[float] = ..., tensors: _Optional[_Iterable[_Union[EdgeTensor, _Mapping]]] = ..., compute_seconds: _Optional[float] = ..., error_budget: _Optional[float] = ..., candidates: _Optional[_Iterable[str]] = ..., top_n: _Optional[int] = ...) -> None: ...

class CodecAdvice(_message.Message):
    __slots__ = ("spec", "ratio", "encoded_bytes", "rel_error", "encode_seconds", "decode_seconds", "transfer_seconds", "direction_seconds", "within_budget", "note")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    ENCODED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REL_ERROR_FIELD_NUMBER: _ClassVar[int]
    ENCODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WITHIN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    spec: str
    ratio: float
    encoded_bytes: int
    rel_error: float
    encode_seconds: float
    decode_seconds: float
    transfer_seconds: float
    direction_seconds: float
    within_budget: bool
    note: str
    def __init__(self, spec: _Optional[str] = ..., ratio: _Optional[float] = ..., encoded_bytes: _Optional[int] = ..., rel_error: _Optional[float] = ..., encode_seconds: _Optional[float] = ..., decode_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., direction_seconds: _Optional[float] = ..., within_budget: _Optional[bool] = ..., note: _Optional[str] = ...) -> None: ...

class DirectionAdvice(_message.Message):
    __slots__ = ("edge", "direction", "shape", "options", "error_source", "error_budget", "baseline_seconds")
    EDGE_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    ERROR_SOURCE_FIELD_NUMBER: _ClassVar[int]
    ERROR_BUDGET_FIELD_NUMBER: _ClassVar[int]
    BASELINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    edge: str
    direction: _tensor_pb2.Direction
    shape: _containers.RepeatedScalarFieldContainer[int]
    options: _containers.RepeatedCompositeFieldContainer[CodecAdvice]
    error_source: str
    error_budget: float
    baseline_seconds: float
    def __init__(self, edge: _Optional[str] = ..., direction: _Optional[_Union[_tensor_pb2.Direction, str]] = ..., shape: _Optional[_Iterable[int]] = ..., options: _Optional[_Iterable[_Union[CodecAdvice, _Mapping]]] = ..., error_source: _Optional[str] = ..., error_budget: _Optional[float] = ..., baseline_seconds: _Optional[float] = ...) -> None: ...

class AdviseResponse(_message.Message):
    __slots__ = ("directions", "predicted_step_seconds", "baseline_step_seconds", "calibration_host", "calibrated_at", "calibration_cached")
    DIRECTIONS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BASELINE_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_HOST_FIELD_NUMBER: _ClassVar[int]
    CALIBRATED_AT_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_CACHED_FIELD_NUMBER: _ClassVar[int]
    directions: _containers.RepeatedCompositeFieldContainer[DirectionAdvice]
    predicted_step_seconds: float
    baseline_step_seconds: float
    calibration_host: str
    calibrated_at: float
    calibration_cached: bool
    def __init__(self, directions: _Optional[_Iterable[_Union[DirectionAdvice, _Mapping]]] = ..., predicted_step_seconds: _Optional[float] = ..., baseline_step_seconds: _Optional[float] = ..., calibration_host: _Optional[str] = ..., calibrated_at: _Optional[float] = ..., calibration_cached: _Optional[bool] = ...) -> None: ...
