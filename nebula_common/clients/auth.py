"""Typed synchronous client of a cluster's auth service.

Callers (CLI, launcher, tests) work with plain dataclasses and the exceptions of
``nebula_common.errors`` instead of protobuf messages and ``grpc.RpcError``; the
server's message is kept, since it is written to be shown to users.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar, cast

import grpc

from nebula_common.errors import (
    AuthenticationError,
    InvalidRequestError,
    NebulaError,
    PermissionDeniedError,
)
from nebula_common.proto.nebula.v1 import auth_pb2, auth_pb2_grpc
from nebula_common.rpc import bearer_metadata
from nebula_common.rpc.internal_tls import internal_channel

_T = TypeVar("_T")

DEFAULT_TIMEOUT_SECONDS = 10.0


class AccountExistsError(NebulaError):
    """CreateAccount named an account that already exists (ALREADY_EXISTS)."""


class ServiceUnavailableError(NebulaError):
    """The auth service could not be reached in time (UNAVAILABLE, DEADLINE_EXCEEDED)."""


_ERRORS: dict[grpc.StatusCode, type[NebulaError]] = {
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.ALREADY_EXISTS: AccountExistsError,
    grpc.StatusCode.UNAVAILABLE: ServiceUnavailableError,
    grpc.StatusCode.NOT_FOUND: InvalidRequestError,
    grpc.StatusCode.FAILED_PRECONDITION: InvalidRequestError,
    grpc.StatusCode.DEADLINE_EXCEEDED: ServiceUnavailableError,
}


@dataclass(frozen=True)
class LoginResult:
    token: str
    expires_at: int
    """Seconds since the Unix epoch."""


@dataclass(frozen=True)
class AccountInfo:
    username: str
    role: str
    cluster_id: str
    created_at: int
    disabled: bool = False
    locked_until: int = 0
    """Seconds since the Unix epoch while locked after failed logins; 0 otherwise."""

    @classmethod
    def from_proto(cls, reply: auth_pb2.Account) -> AccountInfo:
        return cls(
            username=reply.username,
            role=reply.role,
            cluster_id=reply.cluster_id,
            created_at=reply.created_at,
            disabled=reply.disabled,
            locked_until=reply.locked_until,
        )


@dataclass(frozen=True)
class TokenStatus:
    """Server-side verdict on a token; ``reason`` is set only when ``valid`` is False."""

    valid: bool
    username: str
    role: str
    cluster_id: str
    reason: str


class AuthClient:
    """Client of the auth service at ``address`` (cluster-internal, TLS: ``internal_channel``)."""

    def __init__(self, address: str, *, timeout: float = DEFAULT_TIMEOUT_SECONDS) -> None:
        self._address = address
        self._timeout = timeout
        self._channel = cast(grpc.Channel, internal_channel(address, service="auth"))
        self._stub = auth_pb2_grpc.AuthStub(self._channel)

    def login(self, username: str, password: str) -> LoginResult:
        reply = self._call(
            lambda: self._stub.Login(
                auth_pb2.LoginRequest(username=username, password=password), timeout=self._timeout
            )
        )
        return LoginResult(token=reply.token, expires_at=reply.expires_at)

    def create_account(
        self, admin_token: str, username: str, password: str, role: str = "user"
    ) -> AccountInfo:
        request = auth_pb2.CreateAccountRequest(username=username, password=password, role=role)
        reply = self._call(
            lambda: self._stub.CreateAccount(
                request, metadata=bearer_metadata(admin_token), timeout=self._timeout
            )
        )
        return AccountInfo.from_proto(reply)

    def list_accounts(self, admin_token: str) -> list[AccountInfo]:
        reply = self._call(
            lambda: self._stub.ListAccounts(
                auth_pb2.ListAccountsRequest(), metadata=bearer_metadata(admin_token), timeout=self._timeout
            )
        )
        return [AccountInfo.from_proto(a) for a in reply.accounts]

    def disable_account(self, admin_token: str, username: str) -> AccountInfo:
        ref = auth_pb2.AccountRef(username=username)
        meta = bearer_metadata(admin_token)
        return AccountInfo.from_proto(
            self._call(lambda: self._stub.DisableAccount(ref, metadata=meta, timeout=self._timeout))
        )

    def enable_account(self, admin_token: str, username: str) -> AccountInfo:
        ref = auth_pb2.AccountRef(username=username)
        meta = bearer_metadata(admin_token)
        return AccountInfo.from_proto(
            self._call(lambda: self._stub.EnableAccount(ref, metadata=meta, timeout=self._timeout))
        )

    def delete_account(self, admin_token: str, username: str) -> None:
        ref = auth_pb2.AccountRef(username=username)
        meta = bearer_metadata(admin_token)
        self._call(lambda: self._stub.DeleteAccount(ref, metadata=meta, timeout=self._timeout))

    def change_password(
        self, token: str, username: str, new_password: str, current_password: str = ""
    ) -> AccountInfo:
        """Own password (give ``current_password``) or, with an admin token, anyone's."""
        request = auth_pb2.ChangePasswordRequest(
            username=username, current_password=current_password, new_password=new_password
        )
        meta = bearer_metadata(token)
        return AccountInfo.from_proto(
            self._call(lambda: self._stub.ChangePassword(request, metadata=meta, timeout=self._timeout))
        )

    def rotate_signing_key(self, admin_token: str) -> tuple[str, str]:
        """(old kid, new kid); the old key stays published for one token lifetime."""
        meta = bearer_metadata(admin_token)
        reply = self._call(
            lambda: self._stub.RotateSigningKey(
                auth_pb2.RotateSigningKeyRequest(), metadata=meta, timeout=self._timeout
            )
        )
        return reply.old_kid, reply.new_kid

    def verify(self, token: str) -> TokenStatus:
        """Ask the service about ``token``; services that can should verify locally with TokenVerifier."""
        reply = self._call(
            lambda: self._stub.VerifyToken(auth_pb2.VerifyTokenRequest(token=token), timeout=self._timeout)
        )
        return TokenStatus(
            valid=reply.valid,
            username=reply.username,
            role=reply.role,
            cluster_id=reply.cluster_id,
            reason=reply.reason,
        )

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> AuthClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _call(self, invoke: Callable[[], _T]) -> _T:
        try:
            return invoke()
        except grpc.RpcError as exc:
            raise _map_error(self._address, exc) from exc


def _map_error(address: str, exc: grpc.RpcError) -> NebulaError:
    if not isinstance(exc, grpc.Call):
        return NebulaError(f"auth service at {address}: {exc}")
    code, details = exc.code(), exc.details() or ""
    error_type = _ERRORS.get(code, NebulaError)
    if error_type is ServiceUnavailableError:
        return ServiceUnavailableError(f"auth service at {address} unavailable: {details}")
    if error_type is NebulaError:
        return NebulaError(f"auth service at {address} failed ({code.name}): {details}")
    return error_type(details)
