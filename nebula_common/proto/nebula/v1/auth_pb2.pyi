from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CreateAccountRequest(_message.Message):
    __slots__ = ("username", "password", "role")
    USERNAME_FIELD_NUMBER: _ClassVar[int]
    PASSWORD_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    username: str
    password: str
    role: str
    def __init__(self, username: _Optional[str] = ..., password: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...

class Account(_message.Message):
    __slots__ = ("username", "role", "cluster_id", "created_at", "disabled", "locked_until")
    USERNAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    DISABLED_FIELD_NUMBER: _ClassVar[int]
    LOCKED_UNTIL_FIELD_NUMBER: _ClassVar[int]
    username: str
    role: str
    cluster_id: str
    created_at: int
    disabled: bool
    locked_until: int
    def __init__(self, username: _Optional[str] = ..., role: _Optional[str] = ..., cluster_id: _Optional[str] = ..., created_at: _Optional[int] = ..., disabled: _Optional[bool] = ..., locked_until: _Optional[int] = ...) -> None: ...

class AccountRef(_message.Message):
    __slots__ = ("username",)
    USERNAME_FIELD_NUMBER: _ClassVar[int]
    username: str
    def __init__(self, username: _Optional[str] = ...) -> None: ...

class ListAccountsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAccountsResponse(_message.Message):
    __slots__ = ("accounts",)
    ACCOUNTS_FIELD_NUMBER: _ClassVar[int]
    accounts: _containers.RepeatedCompositeFieldContainer[Account]
    def __init__(self, accounts: _Optional[_Iterable[_Union[Account, _Mapping]]] = ...) -> None: ...

class DeleteAccountResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ChangePasswordRequest(_message.Message):
    __slots__ = ("username", "current_password", "new_password")
    USERNAME_FIELD_NUMBER: _ClassVar[int]
    CURRENT_PASSWORD_FIELD_NUMBER: _ClassVar[int]
    NEW_PASSWORD_FIELD_NUMBER: _ClassVar[int]
    username: str
    current_password: str
    new_password: str
    def __init__(self, username: _Optional[str] = ..., current_password: _Optional[str] = ..., new_password: _Optional[str] = ...) -> None: ...

class RotateSigningKeyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RotateSigningKeyResponse(_message.Message):
    __slots__ = ("old_kid", "new_kid")
    OLD_KID_FIELD_NUMBER: _ClassVar[int]
    NEW_KID_FIELD_NUMBER: _ClassVar[int]
    old_kid: str
    new_kid: str
    def __init__(self, old_kid: _Optional[str] = ..., new_kid: _Optional[str] = ...) -> None: ...

class IssueJobTokenRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class JobToken(_message.Message):
    __slots__ = ("token", "expires_at")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    token: str
    expires_at: int
    def __init__(self, token: _Optional[str] = ..., expires_at: _Optional[int] = ...) -> None: ...

class LoginRequest(_message.Message):
    __slots__ = ("username", "password")
    USERNAME_FIELD_NUMBER: _ClassVar[int]
    PASSWORD_FIELD_NUMBER: _ClassVar[int]
    username: str
    password: str
    def __init__(self, username: _Optional[str] = ..., password: _Optional[str] = ...) -> None: ...

class LoginResponse(_message.Message):
    __slots__ = ("token", "expires_at")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    token: str
    expires_at: int
    def __init__(self, token: _Optional[str] = ..., expires_at: _Optional[int] = ...) -> None: ...

class VerifyTokenRequest(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: str
    def __init__(self, token: _Optional[str] = ...) -> None: ...

class VerifyTokenResponse(_message.Message):
    __slots__ = ("valid", "username", "role", "cluster_id", "reason")
    VALID_FIELD_NUMBER: _ClassVar[int]
    USERNAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    valid: bool
    username: str
    role: str
    cluster_id: str
    reason: str
    def __init__(self, valid: _Optional[bool] = ..., username: _Optional[str] = ..., role: _Optional[str] = ..., cluster_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class GetSigningKeysRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SigningKeys(_message.Message):
    __slots__ = ("jwks_json", "issuer", "revocation_epoch", "revocations")
    JWKS_JSON_FIELD_NUMBER: _ClassVar[int]
    ISSUER_FIELD_NUMBER: _ClassVar[int]
    REVOCATION_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REVOCATIONS_FIELD_NUMBER: _ClassVar[int]
    jwks_json: str
    issuer: str
    revocation_epoch: int
    revocations: _containers.RepeatedCompositeFieldContainer[TokenRevocation]
    def __init__(self, jwks_json: _Optional[str] = ..., issuer: _Optional[str] = ..., revocation_epoch: _Optional[int] = ..., revocations: _Optional[_Iterable[_Union[TokenRevocation, _Mapping]]] = ...) -> None: ...

class TokenRevocation(_message.Message):
    __slots__ = ("username", "not_before_ms", "reason")
    USERNAME_FIELD_NUMBER: _ClassVar[int]
    NOT_BEFORE_MS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    username: str
    not_before_ms: int
    reason: str
    def __init__(self, username: _Optional[str] = ..., not_before_ms: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...
