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
from nebula_common.rpc import bearer_metadata, insecure_channel

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


@dataclass(frozen=True)
class TokenStatus:
    """Server-side verdict on a token; ``reason`` is set only when ``valid`` is False."""

    valid: bool
    username: str
    role: str
    cluster_id: str
    reason: str


class AuthClient:
    """Client of the auth service at ``address`` (cluster-internal, plaintext)."""

    def __init__(self, address: str, *, timeout: float = DEFAULT_TIMEOUT_SECONDS) -> None:
        self._address = address
        self._timeout = timeout
        self._channel = cast(grpc.Channel, insecure_channel(address))
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
        return AccountInfo(
            username=reply.username, role=reply.role, cluster_id=reply.cluster_id, created_at=reply.created_at
        )

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
