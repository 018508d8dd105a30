from nebula_common.proto.nebula.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SignalKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SIGNAL_KIND_UNSPECIFIED: _ClassVar[SignalKind]
    SIGNAL_KIND_READY: _ClassVar[SignalKind]
    SIGNAL_KIND_SYNC: _ClassVar[SignalKind]
    SIGNAL_KIND_EVAL_DONE: _ClassVar[SignalKind]
    SIGNAL_KIND_RESUME: _ClassVar[SignalKind]
SIGNAL_KIND_UNSPECIFIED: SignalKind
SIGNAL_KIND_READY: SignalKind
SIGNAL_KIND_SYNC: SignalKind
SIGNAL_KIND_EVAL_DONE: SignalKind
SIGNAL_KIND_RESUME: SignalKind

class EdgeTicketRequest(_message.Message):
    __slots__ = ("open",)
    OPEN_FIELD_NUMBER: _ClassVar[int]
    open: EdgeOpen
    def __init__(self, open: _Optional[_Union[EdgeOpen, _Mapping]] = ...) -> None: ...

class EdgeTicket(_message.Message):
    __slots__ = ("ticket", "expires_in_ms")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_MS_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    expires_in_ms: int
    def __init__(self, ticket: _Optional[bytes] = ..., expires_in_ms: _Optional[int] = ...) -> None: ...

class RenewEdgesRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class RenewEdgesReply(_message.Message):
    __slots__ = ("renewed", "expires_at")
    RENEWED_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    renewed: int
    expires_at: int
    def __init__(self, renewed: _Optional[int] = ..., expires_at: _Optional[int] = ...) -> None: ...

class EdgeOpen(_message.Message):
    __slots__ = ("job_id", "edge", "reconnect", "epoch", "link_framing", "peer_cluster")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EDGE_FIELD_NUMBER: _ClassVar[int]
    RECONNECT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LINK_FRAMING_FIELD_NUMBER: _ClassVar[int]
    PEER_CLUSTER_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    edge: str
    reconnect: bool
    epoch: int
    link_framing: int
    peer_cluster: str
    def __init__(self, job_id: _Optional[str] = ..., edge: _Optional[str] = ..., reconnect: _Optional[bool] = ..., epoch: _Optional[int] = ..., link_framing: _Optional[int] = ..., peer_cluster: _Optional[str] = ...) -> None: ...

class EdgeClose(_message.Message):
    __slots__ = ("reason", "error")
    REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    reason: str
    error: bool
    def __init__(self, reason: _Optional[str] = ..., error: _Optional[bool] = ...) -> None: ...

class EdgeReady(_message.Message):
    __slots__ = ("peer_cluster", "max_window_bytes", "link_up", "epoch", "link_framing")
    PEER_CLUSTER_FIELD_NUMBER: _ClassVar[int]
    MAX_WINDOW_BYTES_FIELD_NUMBER: _ClassVar[int]
    LINK_UP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LINK_FRAMING_FIELD_NUMBER: _ClassVar[int]
    peer_cluster: str
    max_window_bytes: int
    link_up: bool
    epoch: int
    link_framing: int
    def __init__(self, peer_cluster: _Optional[str] = ..., max_window_bytes: _Optional[int] = ..., link_up: _Optional[bool] = ..., epoch: _Optional[int] = ..., link_framing: _Optional[int] = ...) -> None: ...

class EdgeRestart(_message.Message):
    __slots__ = ("epoch", "reason")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    reason: str
    def __init__(self, epoch: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class EdgeSignal(_message.Message):
    __slots__ = ("seq", "direction", "kind", "step", "values")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    seq: int
    direction: _tensor_pb2.Direction
    kind: SignalKind
    step: int
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, seq: _Optional[int] = ..., direction: _Optional[_Union[_tensor_pb2.Direction, str]] = ..., kind: _Optional[_Union[SignalKind, str]] = ..., step: _Optional[int] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class EdgeAck(_message.Message):
    __slots__ = ("direction", "received", "max_bytes", "resume")
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    direction: _tensor_pb2.Direction
    received: int
    max_bytes: int
    resume: bool
    def __init__(self, direction: _Optional[_Union[_tensor_pb2.Direction, str]] = ..., received: _Optional[int] = ..., max_bytes: _Optional[int] = ..., resume: _Optional[bool] = ...) -> None: ...

class LinkNotice(_message.Message):
    __slots__ = ("up", "reason")
    UP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    up: bool
    reason: str
    def __init__(self, up: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class FramedItem(_message.Message):
    __slots__ = ("job_id", "edge", "item", "epoch")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EDGE_FIELD_NUMBER: _ClassVar[int]
    ITEM_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    edge: str
    item: EdgeMessage
    epoch: int
    def __init__(self, job_id: _Optional[str] = ..., edge: _Optional[str] = ..., item: _Optional[_Union[EdgeMessage, _Mapping]] = ..., epoch: _Optional[int] = ...) -> None: ...

class EdgeMessage(_message.Message):
    __slots__ = ("open", "frame", "close", "ready", "signal", "ack", "notice", "restart", "framed")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    NOTICE_FIELD_NUMBER: _ClassVar[int]
    RESTART_FIELD_NUMBER: _ClassVar[int]
    FRAMED_FIELD_NUMBER: _ClassVar[int]
    open: EdgeOpen
    frame: _tensor_pb2.TensorFrame
    close: EdgeClose
    ready: EdgeReady
    signal: EdgeSignal
    ack: EdgeAck
    notice: LinkNotice
    restart: EdgeRestart
    framed: FramedItem
    def __init__(self, open: _Optional[_Union[EdgeOpen, _Mapping]] = ..., frame: _Optional[_Union[_tensor_pb2.TensorFrame, _Mapping]] = ..., close: _Optional[_Union[EdgeClose, _Mapping]] = ..., ready: _Optional[_Union[EdgeReady, _Mapping]] = ..., signal: _Optional[_Union[EdgeSignal, _Mapping]] = ..., ack: _Optional[_Union[EdgeAck, _Mapping]] = ..., notice: _Optional[_Union[LinkNotice, _Mapping]] = ..., restart: _Optional[_Union[EdgeRestart, _Mapping]] = ..., framed: _Optional[_Union[FramedItem, _Mapping]] = ...) -> None: ...

class GetLinkStatusRequest(_message.Message):
    __slots__ = ("peer_cluster", "measure_bandwidth")
    PEER_CLUSTER_FIELD_NUMBER: _ClassVar[int]
    MEASURE_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    peer_cluster: str
    measure_bandwidth: bool
    def __init__(self, peer_cluster: _Optional[str] = ..., measure_bandwidth: _Optional[bool] = ...) -> None: ...

class LinkCounters(_message.Message):
    __slots__ = ("bytes", "payload_bytes", "raw_bytes", "frames")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    payload_bytes: int
    raw_bytes: int
    frames: int
    def __init__(self, bytes: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., raw_bytes: _Optional[int] = ..., frames: _Optional[int] = ...) -> None: ...

class LinkStatus(_message.Message):
    __slots__ = ("cluster_id", "expected_peer", "connected", "verified_peer_identity", "link_role", "sent", "received", "peer_certificate_serial", "link_sessions", "certificate_serial", "certificate_not_after", "certificate_generation", "peers", "rtt_seconds", "bandwidth_bps", "bandwidth_age_seconds", "min_rtt_seconds", "link_carrier")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_PEER_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_PEER_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    LINK_ROLE_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    PEER_CERTIFICATE_SERIAL_FIELD_NUMBER: _ClassVar[int]
    LINK_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_SERIAL_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_NOT_AFTER_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    RTT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MIN_RTT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LINK_CARRIER_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    expected_peer: str
    connected: bool
    verified_peer_identity: str
    link_role: str
    sent: LinkCounters
    received: LinkCounters
    peer_certificate_serial: str
    link_sessions: int
    certificate_serial: str
    certificate_not_after: int
    certificate_generation: int
    peers: _containers.RepeatedScalarFieldContainer[str]
    rtt_seconds: float
    bandwidth_bps: float
    bandwidth_age_seconds: float
    min_rtt_seconds: float
    link_carrier: str
    def __init__(self, cluster_id: _Optional[str] = ..., expected_peer: _Optional[str] = ..., connected: _Optional[bool] = ..., verified_peer_identity: _Optional[str] = ..., link_role: _Optional[str] = ..., sent: _Optional[_Union[LinkCounters, _Mapping]] = ..., received: _Optional[_Union[LinkCounters, _Mapping]] = ..., peer_certificate_serial: _Optional[str] = ..., link_sessions: _Optional[int] = ..., certificate_serial: _Optional[str] = ..., certificate_not_after: _Optional[int] = ..., certificate_generation: _Optional[int] = ..., peers: _Optional[_Iterable[str]] = ..., rtt_seconds: _Optional[float] = ..., bandwidth_bps: _Optional[float] = ..., bandwidth_age_seconds: _Optional[float] = ..., min_rtt_seconds: _Optional[float] = ..., link_carrier: _Optional[str] = ...) -> None: ...
