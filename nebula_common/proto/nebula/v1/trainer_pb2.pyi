from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
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
    STAGE_STATE_RECOVERING: _ClassVar[StageState]
STAGE_STATE_UNSPECIFIED: StageState
STAGE_STATE_PENDING: StageState
STAGE_STATE_RUNNING: StageState
STAGE_STATE_SUCCEEDED: StageState
STAGE_STATE_FAILED: StageState
STAGE_STATE_CANCELLED: StageState
STAGE_STATE_RECOVERING: StageState

class StageSpec(_message.Message):
    __slots__ = ("job_id", "stage", "edge", "steps", "codec_forward", "codec_backward", "program", "codec_choice", "spec_digest", "peer_cluster", "downstream_edge")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    EDGE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FORWARD_FIELD_NUMBER: _ClassVar[int]
    CODEC_BACKWARD_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    CODEC_CHOICE_FIELD_NUMBER: _ClassVar[int]
    SPEC_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PEER_CLUSTER_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_EDGE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    stage: str
    edge: str
    steps: int
    codec_forward: str
    codec_backward: str
    program: ProgramStage
    codec_choice: str
    spec_digest: str
    peer_cluster: str
    downstream_edge: ChainEdge
    def __init__(self, job_id: _Optional[str] = ..., stage: _Optional[str] = ..., edge: _Optional[str] = ..., steps: _Optional[int] = ..., codec_forward: _Optional[str] = ..., codec_backward: _Optional[str] = ..., program: _Optional[_Union[ProgramStage, _Mapping]] = ..., codec_choice: _Optional[str] = ..., spec_digest: _Optional[str] = ..., peer_cluster: _Optional[str] = ..., downstream_edge: _Optional[_Union[ChainEdge, _Mapping]] = ...) -> None: ...

class ChainEdge(_message.Message):
    __slots__ = ("edge", "codec_forward", "codec_backward", "peer_cluster")
    EDGE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FORWARD_FIELD_NUMBER: _ClassVar[int]
    CODEC_BACKWARD_FIELD_NUMBER: _ClassVar[int]
    PEER_CLUSTER_FIELD_NUMBER: _ClassVar[int]
    edge: str
    codec_forward: str
    codec_backward: str
    peer_cluster: str
    def __init__(self, edge: _Optional[str] = ..., codec_forward: _Optional[str] = ..., codec_backward: _Optional[str] = ..., peer_cluster: _Optional[str] = ...) -> None: ...

class OptimizerConfig(_message.Message):
    __slots__ = ("name", "learning_rate", "weight_decay", "momentum", "lr_schedule", "warmup_steps")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    LR_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    name: str
    learning_rate: float
    weight_decay: float
    momentum: float
    lr_schedule: str
    warmup_steps: int
    def __init__(self, name: _Optional[str] = ..., learning_rate: _Optional[float] = ..., weight_decay: _Optional[float] = ..., momentum: _Optional[float] = ..., lr_schedule: _Optional[str] = ..., warmup_steps: _Optional[int] = ...) -> None: ...

class ProgramStage(_message.Message):
    __slots__ = ("role", "module_source", "module_name", "options_json", "batch_size", "micro_batches", "num_examples", "schedule", "max_in_flight", "seed", "stage_index", "optimizer", "checkpoint_interval", "resume_job_id", "resume_step", "mode", "sync_lag", "replicas", "payload", "dataset", "initial_state", "initial_step", "parallel", "shard_size", "stage_count")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODULE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    MODULE_NAME_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    RESUME_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_STEP_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SYNC_LAG_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    INITIAL_STATE_FIELD_NUMBER: _ClassVar[int]
    INITIAL_STEP_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    SHARD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STAGE_COUNT_FIELD_NUMBER: _ClassVar[int]
    role: str
    module_source: str
    module_name: str
    options_json: str
    batch_size: int
    micro_batches: int
    num_examples: int
    schedule: str
    max_in_flight: int
    seed: int
    stage_index: int
    optimizer: OptimizerConfig
    checkpoint_interval: int
    resume_job_id: str
    resume_step: int
    mode: str
    sync_lag: int
    replicas: int
    payload: str
    dataset: str
    initial_state: bytes
    initial_step: int
    parallel: str
    shard_size: int
    stage_count: int
    def __init__(self, role: _Optional[str] = ..., module_source: _Optional[str] = ..., module_name: _Optional[str] = ..., options_json: _Optional[str] = ..., batch_size: _Optional[int] = ..., micro_batches: _Optional[int] = ..., num_examples: _Optional[int] = ..., schedule: _Optional[str] = ..., max_in_flight: _Optional[int] = ..., seed: _Optional[int] = ..., stage_index: _Optional[int] = ..., optimizer: _Optional[_Union[OptimizerConfig, _Mapping]] = ..., checkpoint_interval: _Optional[int] = ..., resume_job_id: _Optional[str] = ..., resume_step: _Optional[int] = ..., mode: _Optional[str] = ..., sync_lag: _Optional[int] = ..., replicas: _Optional[int] = ..., payload: _Optional[str] = ..., dataset: _Optional[str] = ..., initial_state: _Optional[bytes] = ..., initial_step: _Optional[int] = ..., parallel: _Optional[str] = ..., shard_size: _Optional[int] = ..., stage_count: _Optional[int] = ...) -> None: ...

class AssignStageRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: StageSpec
    def __init__(self, spec: _Optional[_Union[StageSpec, _Mapping]] = ...) -> None: ...

class AssignStageResponse(_message.Message):
    __slots__ = ("job_id", "authorised_by", "placement")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AUTHORISED_BY_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    authorised_by: str
    placement: str
    def __init__(self, job_id: _Optional[str] = ..., authorised_by: _Optional[str] = ..., placement: _Optional[str] = ...) -> None: ...

class WatchStageRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class StageStatus(_message.Message):
    __slots__ = ("job_id", "stage", "state", "steps_done", "loss", "step_seconds", "wait_seconds", "bytes_sent", "bytes_received", "raw_bytes_sent", "raw_bytes_received", "message", "checkpoint_step", "compute_seconds", "local_loss", "codec_forward", "codec_backward", "codec_choice", "epoch", "resumed_from_step", "edges")
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
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FORWARD_FIELD_NUMBER: _ClassVar[int]
    CODEC_BACKWARD_FIELD_NUMBER: _ClassVar[int]
    CODEC_CHOICE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    EDGES_FIELD_NUMBER: _ClassVar[int]
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
    checkpoint_step: int
    compute_seconds: float
    local_loss: float
    codec_forward: str
    codec_backward: str
    codec_choice: str
    epoch: int
    resumed_from_step: int
    edges: _containers.RepeatedCompositeFieldContainer[EdgeTraffic]
    def __init__(self, job_id: _Optional[str] = ..., stage: _Optional[str] = ..., state: _Optional[_Union[StageState, str]] = ..., steps_done: _Optional[int] = ..., loss: _Optional[float] = ..., step_seconds: _Optional[float] = ..., wait_seconds: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., raw_bytes_sent: _Optional[int] = ..., raw_bytes_received: _Optional[int] = ..., message: _Optional[str] = ..., checkpoint_step: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., local_loss: _Optional[float] = ..., codec_forward: _Optional[str] = ..., codec_backward: _Optional[str] = ..., codec_choice: _Optional[str] = ..., epoch: _Optional[int] = ..., resumed_from_step: _Optional[int] = ..., edges: _Optional[_Iterable[_Union[EdgeTraffic, _Mapping]]] = ...) -> None: ...

class EdgeTraffic(_message.Message):
    __slots__ = ("edge", "bytes_sent", "raw_bytes_sent", "frames_sent", "bytes_received", "raw_bytes_received", "frames_received")
    EDGE_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    FRAMES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    FRAMES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    edge: str
    bytes_sent: int
    raw_bytes_sent: int
    frames_sent: int
    bytes_received: int
    raw_bytes_received: int
    frames_received: int
    def __init__(self, edge: _Optional[str] = ..., bytes_sent: _Optional[int] = ..., raw_bytes_sent: _Optional[int] = ..., frames_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., raw_bytes_received: _Optional[int] = ..., frames_received: _Optional[int] = ...) -> None: ...

class CancelStageRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CancelStageResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("job_id", "stage")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    stage: str
    def __init__(self, job_id: _Optional[str] = ..., stage: _Optional[str] = ...) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, steps: _Optional[_Iterable[int]] = ...) -> None: ...

class ListStagesRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class StageRecordInfo(_message.Message):
    __slots__ = ("status", "owner", "spec_digest", "started_unix", "ended_unix", "steps", "edge")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SPEC_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    ENDED_UNIX_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    EDGE_FIELD_NUMBER: _ClassVar[int]
    status: StageStatus
    owner: str
    spec_digest: str
    started_unix: float
    ended_unix: float
    steps: int
    edge: str
    def __init__(self, status: _Optional[_Union[StageStatus, _Mapping]] = ..., owner: _Optional[str] = ..., spec_digest: _Optional[str] = ..., started_unix: _Optional[float] = ..., ended_unix: _Optional[float] = ..., steps: _Optional[int] = ..., edge: _Optional[str] = ...) -> None: ...

class ListStagesResponse(_message.Message):
    __slots__ = ("stages",)
    STAGES_FIELD_NUMBER: _ClassVar[int]
    stages: _containers.RepeatedCompositeFieldContainer[StageRecordInfo]
    def __init__(self, stages: _Optional[_Iterable[_Union[StageRecordInfo, _Mapping]]] = ...) -> None: ...
