from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StageState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STAGE_STATE_UNSPECIFIED: _ClassVar[StageState]
    STAGE_STATE_PENDING: _ClassVar[StageState]
    STAGE_STATE_RUNNING: _ClassVar[StageState]
    STAGE_STATE_SUCCEEDED: _ClassVar[StageState]
    STAGE_STATE_FAILED: _ClassVar[StageState]
    STAGE_STATE_CANCELLED: _ClassVar[StageState]
STAGE_STATE_UNSPECIFIED: StageState
STAGE_STATE_PENDING: StageState
STAGE_STATE_RUNNING: StageState
STAGE_STATE_SUCCEEDED: StageState
STAGE_STATE_FAILED: StageState
STAGE_STATE_CANCELLED: StageState

class AbnetConfig(_message.Message):
    __slots__ = ("d_model", "n_heads", "n_layers", "batch_size", "micro_batches", "learning_rate", "seed")
    D_MODEL_FIELD_NUMBER: _ClassVar[int]
    N_HEADS_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    d_model: int
    n_heads: int
    n_layers: int
    batch_size: int
    micro_batches: int
    learning_rate: float
    seed: int
    def __init__(self, d_model: _Optional[int] = ..., n_heads: _Optional[int] = ..., n_layers: _Optional[int] = ..., batch_size: _Optional[int] = ..., micro_batches: _Optional[int] = ..., learning_rate: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class StageSpec(_message.Message):
    __slots__ = ("job_id", "scenario", "stage", "edge", "steps", "codec_forward", "codec_backward", "abnet")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SCENARIO_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    EDGE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FORWARD_FIELD_NUMBER: _ClassVar[int]
    CODEC_BACKWARD_FIELD_NUMBER: _ClassVar[int]
    ABNET_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    scenario: str
    stage: str
    edge: str
    steps: int
    codec_forward: str
    codec_backward: str
    abnet: AbnetConfig
    def __init__(self, job_id: _Optional[str] = ..., scenario: _Optional[str] = ..., stage: _Optional[str] = ..., edge: _Optional[str] = ..., steps: _Optional[int] = ..., codec_forward: _Optional[str] = ..., codec_backward: _Optional[str] = ..., abnet: _Optional[_Union[AbnetConfig, _Mapping]] = ...) -> None: ...

class AssignStageRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: StageSpec
    def __init__(self, spec: _Optional[_Union[StageSpec, _Mapping]] = ...) -> None: ...

class AssignStageResponse(_message.Message):
    __slots__ = ("job_id", "authorised_by")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AUTHORISED_BY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    authorised_by: str
    def __init__(self, job_id: _Optional[str] = ..., authorised_by: _Optional[str] = ...) -> None: ...

class WatchStageRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class StageStatus(_message.Message):
    __slots__ = ("job_id", "stage", "state", "steps_done", "loss", "step_seconds", "wait_seconds", "bytes_sent", "bytes_received", "raw_bytes_sent", "raw_bytes_received", "message")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    stage: str
    state: StageState
    steps_done: int
    loss: float
    step_seconds: float
    wait_seconds: float
    bytes_sent: int
    bytes_received: int
    raw_bytes_sent: int
    raw_bytes_received: int
    message: str
    def __init__(self, job_id: _Optional[str] = ..., stage: _Optional[str] = ..., state: _Optional[_Union[StageState, str]] = ..., steps_done: _Optional[int] = ..., loss: _Optional[float] = ..., step_seconds: _Optional[float] = ..., wait_seconds: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., raw_bytes_sent: _Optional[int] = ..., raw_bytes_received: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class CancelStageRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CancelStageResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
