from nebula_common.proto.nebula.v1 import relay_pb2 as _relay_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Handshake(_message.Message):
    __slots__ = ("protocol_version", "cluster_id", "software_version", "link_framing", "lanes", "session_id", "lane", "raw_link", "raw_preamble", "audit_witness", "paced", "express")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    LINK_FRAMING_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    RAW_LINK_FIELD_NUMBER: _ClassVar[int]
    RAW_PREAMBLE_FIELD_NUMBER: _ClassVar[int]
    AUDIT_WITNESS_FIELD_NUMBER: _ClassVar[int]
    PACED_FIELD_NUMBER: _ClassVar[int]
    EXPRESS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    cluster_id: str
    software_version: str
    link_framing: int
    lanes: bool
    session_id: bytes
    lane: int
    raw_link: int
    raw_preamble: bytes
    audit_witness: bool
    paced: bool
    express: bool
    def __init__(self, protocol_version: _Optional[int] = ..., cluster_id: _Optional[str] = ..., software_version: _Optional[str] = ..., link_framing: _Optional[int] = ..., lanes: _Optional[bool] = ..., session_id: _Optional[bytes] = ..., lane: _Optional[int] = ..., raw_link: _Optional[int] = ..., raw_preamble: _Optional[bytes] = ..., audit_witness: _Optional[bool] = ..., paced: _Optional[bool] = ..., express: _Optional[bool] = ...) -> None: ...

class LinkFragment(_message.Message):
    __slots__ = ("stream", "offset", "data", "last")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    stream: int
    offset: int
    data: bytes
    last: bool
    def __init__(self, stream: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class LinkReceived(_message.Message):
    __slots__ = ("bytes", "lane_bytes")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LANE_BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    lane_bytes: int
    def __init__(self, bytes: _Optional[int] = ..., lane_bytes: _Optional[int] = ...) -> None: ...

class AuditHead(_message.Message):
    __slots__ = ("log_id", "count", "head", "read_at")
    LOG_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    READ_AT_FIELD_NUMBER: _ClassVar[int]
    log_id: str
    count: int
    head: str
    read_at: str
    def __init__(self, log_id: _Optional[str] = ..., count: _Optional[int] = ..., head: _Optional[str] = ..., read_at: _Optional[str] = ...) -> None: ...

class LaneMark(_message.Message):
    __slots__ = ("seq", "last", "after")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    seq: int
    last: bool
    after: int
    def __init__(self, seq: _Optional[int] = ..., last: _Optional[bool] = ..., after: _Optional[int] = ...) -> None: ...

class RoutedItem(_message.Message):
    __slots__ = ("job_id", "edge", "item", "epoch")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EDGE_FIELD_NUMBER: _ClassVar[int]
    ITEM_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    edge: str
    item: _relay_pb2.EdgeMessage
    epoch: int
    def __init__(self, job_id: _Optional[str] = ..., edge: _Optional[str] = ..., item: _Optional[_Union[_relay_pb2.EdgeMessage, _Mapping]] = ..., epoch: _Optional[int] = ...) -> None: ...

class Ping(_message.Message):
    __slots__ = ("nonce", "padding")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    nonce: int
    padding: bytes
    def __init__(self, nonce: _Optional[int] = ..., padding: _Optional[bytes] = ...) -> None: ...

class Pong(_message.Message):
    __slots__ = ("nonce",)
    NONCE_FIELD_NUMBER: _ClassVar[int]
    nonce: int
    def __init__(self, nonce: _Optional[int] = ...) -> None: ...

class LinkMessage(_message.Message):
    __slots__ = ("hello", "routed", "ping", "pong", "framed", "mark", "audit_head", "fragment", "received")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    ROUTED_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    PONG_FIELD_NUMBER: _ClassVar[int]
    FRAMED_FIELD_NUMBER: _ClassVar[int]
    MARK_FIELD_NUMBER: _ClassVar[int]
    AUDIT_HEAD_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    hello: Handshake
    routed: RoutedItem
    ping: Ping
    pong: Pong
    framed: _relay_pb2.FramedItem
    mark: LaneMark
    audit_head: AuditHead
    fragment: LinkFragment
    received: LinkReceived
    def __init__(self, hello: _Optional[_Union[Handshake, _Mapping]] = ..., routed: _Optional[_Union[RoutedItem, _Mapping]] = ..., ping: _Optional[_Union[Ping, _Mapping]] = ..., pong: _Optional[_Union[Pong, _Mapping]] = ..., framed: _Optional[_Union[_relay_pb2.FramedItem, _Mapping]] = ..., mark: _Optional[_Union[LaneMark, _Mapping]] = ..., audit_head: _Optional[_Union[AuditHead, _Mapping]] = ..., fragment: _Optional[_Union[LinkFragment, _Mapping]] = ..., received: _Optional[_Union[LinkReceived, _Mapping]] = ...) -> None: ...
