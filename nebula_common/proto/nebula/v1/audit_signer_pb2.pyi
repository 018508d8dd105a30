from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GetSealKeyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SealKey(_message.Message):
    __slots__ = ("key_id", "public_pem", "log_id", "count", "head")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_PEM_FIELD_NUMBER: _ClassVar[int]
    LOG_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    public_pem: bytes
    log_id: str
    count: int
    head: str
    def __init__(self, key_id: _Optional[str] = ..., public_pem: _Optional[bytes] = ..., log_id: _Optional[str] = ..., count: _Optional[int] = ..., head: _Optional[str] = ...) -> None: ...

class SignSealRequest(_message.Message):
    __slots__ = ("log_id", "count", "head", "ts", "records")
    LOG_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    log_id: str
    count: int
    head: str
    ts: str
    records: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, log_id: _Optional[str] = ..., count: _Optional[int] = ..., head: _Optional[str] = ..., ts: _Optional[str] = ..., records: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SealSignature(_message.Message):
    __slots__ = ("sig", "key_id")
    SIG_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    sig: str
    key_id: str
    def __init__(self, sig: _Optional[str] = ..., key_id: _Optional[str] = ...) -> None: ...
