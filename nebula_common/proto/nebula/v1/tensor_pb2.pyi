from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Direction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIRECTION_UNSPECIFIED: _ClassVar[Direction]
    DIRECTION_FORWARD: _ClassVar[Direction]
    DIRECTION_BACKWARD: _ClassVar[Direction]
DIRECTION_UNSPECIFIED: Direction
DIRECTION_FORWARD: Direction
DIRECTION_BACKWARD: Direction

class TensorHeader(_message.Message):
    __slots__ = ("job_id", "edge", "direction", "step", "micro_batch", "dtype", "shape", "codec", "payload_size", "checksum", "raw_size", "frame_id", "checksum_version", "delta", "delta_base_checksum", "present_rows")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EDGE_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    RAW_SIZE_FIELD_NUMBER: _ClassVar[int]
    FRAME_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_VERSION_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    DELTA_BASE_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PRESENT_ROWS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    edge: str
    direction: Direction
    step: int
    micro_batch: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    codec: str
    payload_size: int
    checksum: int
    raw_size: int
    frame_id: int
    checksum_version: int
    delta: bool
    delta_base_checksum: int
    present_rows: bytes
    def __init__(self, job_id: _Optional[str] = ..., edge: _Optional[str] = ..., direction: _Optional[_Union[Direction, str]] = ..., step: _Optional[int] = ..., micro_batch: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., codec: _Optional[str] = ..., payload_size: _Optional[int] = ..., checksum: _Optional[int] = ..., raw_size: _Optional[int] = ..., frame_id: _Optional[int] = ..., checksum_version: _Optional[int] = ..., delta: _Optional[bool] = ..., delta_base_checksum: _Optional[int] = ..., present_rows: _Optional[bytes] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("frame_id", "offset", "data", "last")
    FRAME_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    frame_id: int
    offset: int
    data: bytes
    last: bool
    def __init__(self, frame_id: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class TensorFrame(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: TensorHeader
    chunk: TensorChunk
    def __init__(self, header: _Optional[_Union[TensorHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...
