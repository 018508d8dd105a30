from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class CrlUpdate(_message.Message):
    __slots__ = ("cluster_id", "crl_pem", "crl_number")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    CRL_PEM_FIELD_NUMBER: _ClassVar[int]
    CRL_NUMBER_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    crl_pem: bytes
    crl_number: int
    def __init__(self, cluster_id: _Optional[str] = ..., crl_pem: _Optional[bytes] = ..., crl_number: _Optional[int] = ...) -> None: ...
