from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class AuditQuery(_message.Message):
    __slots__ = ("account", "job_id", "event", "since_unix", "until_unix", "limit")
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    SINCE_UNIX_FIELD_NUMBER: _ClassVar[int]
    UNTIL_UNIX_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    account: str
    job_id: str
    event: str
    since_unix: float
    until_unix: float
    limit: int
    def __init__(self, account: _Optional[str] = ..., job_id: _Optional[str] = ..., event: _Optional[str] = ..., since_unix: _Optional[float] = ..., until_unix: _Optional[float] = ..., limit: _Optional[int] = ...) -> None: ...

class AuditRecords(_message.Message):
    __slots__ = ("records_json", "truncated", "total_records")
    RECORDS_JSON_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_RECORDS_FIELD_NUMBER: _ClassVar[int]
    records_json: _containers.RepeatedScalarFieldContainer[str]
    truncated: bool
    total_records: int
    def __init__(self, records_json: _Optional[_Iterable[str]] = ..., truncated: _Optional[bool] = ..., total_records: _Optional[int] = ...) -> None: ...

class GetAuditKeyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AuditKey(_message.Message):
    __slots__ = ("public_key_pem", "key_id", "log_id", "service", "cluster_id")
    PUBLIC_KEY_PEM_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    LOG_ID_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    public_key_pem: str
    key_id: str
    log_id: str
    service: str
    cluster_id: str
    def __init__(self, public_key_pem: _Optional[str] = ..., key_id: _Optional[str] = ..., log_id: _Optional[str] = ..., service: _Optional[str] = ..., cluster_id: _Optional[str] = ...) -> None: ...
