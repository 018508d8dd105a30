from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DatasetRef(_message.Message):
    __slots__ = ("owner", "name")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    owner: str
    name: str
    def __init__(self, owner: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class Dataset(_message.Message):
    __slots__ = ("owner", "name", "records", "size_bytes", "sha256", "created_at")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    owner: str
    name: str
    records: int
    size_bytes: int
    sha256: str
    created_at: int
    def __init__(self, owner: _Optional[str] = ..., name: _Optional[str] = ..., records: _Optional[int] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., created_at: _Optional[int] = ...) -> None: ...

class UploadDatasetHeader(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UploadDatasetRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: UploadDatasetHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[UploadDatasetHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class ImportDatasetRequest(_message.Message):
    __slots__ = ("name", "inbox_path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INBOX_PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    inbox_path: str
    def __init__(self, name: _Optional[str] = ..., inbox_path: _Optional[str] = ...) -> None: ...

class ListDatasetsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDatasetsResponse(_message.Message):
    __slots__ = ("owned", "granted")
    OWNED_FIELD_NUMBER: _ClassVar[int]
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    owned: _containers.RepeatedCompositeFieldContainer[Dataset]
    granted: _containers.RepeatedCompositeFieldContainer[Dataset]
    def __init__(self, owned: _Optional[_Iterable[_Union[Dataset, _Mapping]]] = ..., granted: _Optional[_Iterable[_Union[Dataset, _Mapping]]] = ...) -> None: ...

class DeleteDatasetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DownloadChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class GrantRequest(_message.Message):
    __slots__ = ("name", "grantee", "expires_at")
    NAME_FIELD_NUMBER: _ClassVar[int]
    GRANTEE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    name: str
    grantee: str
    expires_at: int
    def __init__(self, name: _Optional[str] = ..., grantee: _Optional[str] = ..., expires_at: _Optional[int] = ...) -> None: ...

class GrantInfo(_message.Message):
    __slots__ = ("owner", "name", "grantee", "granted_at", "expires_at")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    GRANTEE_FIELD_NUMBER: _ClassVar[int]
    GRANTED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    owner: str
    name: str
    grantee: str
    granted_at: int
    expires_at: int
    def __init__(self, owner: _Optional[str] = ..., name: _Optional[str] = ..., grantee: _Optional[str] = ..., granted_at: _Optional[int] = ..., expires_at: _Optional[int] = ...) -> None: ...

class RevokeRequest(_message.Message):
    __slots__ = ("name", "grantee")
    NAME_FIELD_NUMBER: _ClassVar[int]
    GRANTEE_FIELD_NUMBER: _ClassVar[int]
    name: str
    grantee: str
    def __init__(self, name: _Optional[str] = ..., grantee: _Optional[str] = ...) -> None: ...

class RevokeResponse(_message.Message):
    __slots__ = ("revoked",)
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    revoked: bool
    def __init__(self, revoked: _Optional[bool] = ...) -> None: ...

class ListGrantsResponse(_message.Message):
    __slots__ = ("grants",)
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    grants: _containers.RepeatedCompositeFieldContainer[GrantInfo]
    def __init__(self, grants: _Optional[_Iterable[_Union[GrantInfo, _Mapping]]] = ...) -> None: ...

class ReadBatchRequest(_message.Message):
    __slots__ = ("dataset", "example_ids")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    EXAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    dataset: DatasetRef
    example_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dataset: _Optional[_Union[DatasetRef, _Mapping]] = ..., example_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("records_json",)
    RECORDS_JSON_FIELD_NUMBER: _ClassVar[int]
    records_json: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, records_json: _Optional[_Iterable[str]] = ...) -> None: ...
