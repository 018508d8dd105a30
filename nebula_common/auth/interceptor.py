"""The bearer-token check of every Nebula service, written once as a gRPC server interceptor.

Each service installs ``TokenAuthInterceptor`` on its internal server; servicers
then read who called with ``caller()`` instead of parsing metadata themselves.
Every refusal is answered the same way everywhere (UNAUTHENTICATED for a missing,
malformed, expired, revoked or other-cluster token; PERMISSION_DENIED for a
non-admin on an admin method), counted in ``nebula_rpc_refusals_total`` and
appended to the service's audit log as ``auth.refused`` with the method, the
reason and the peer address.

The check runs inside the RPC's own task, wrapped around the servicer method,
so the caller it stores in a context variable is visible to exactly that call.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from prometheus_client import Counter

from nebula_common.auth.policy import is_public, job_token_may_call, needs_admin
from nebula_common.auth.verifier import Principal, TokenVerifier
from nebula_common.errors import AuthenticationError
from nebula_common.rpc.metadata import bearer_token_from_metadata

log = logging.getLogger(__name__)

REFUSALS = Counter(
    "nebula_rpc_refusals",
    "Internal RPCs refused before reaching the servicer, by service, method and reason.",
    ["service", "method", "reason"],
)

AccountCheck = Callable[[Principal], Awaitable[str | None]]
"""Extra per-call check of a verified principal; returns a refusal reason or None."""


class AuditSink(Protocol):
    """What the interceptor needs of an audit log (kept structural so auth never imports audit)."""

    def append(self, event: str, **fields: Any) -> object: ...


@dataclass(frozen=True)
class Caller:
    """Who made the current call, and the token they proved it with (to act on their behalf)."""

    principal: Principal
    token: str


_CALLER: contextvars.ContextVar[Caller] = contextvars.ContextVar("nebula_caller")


def caller() -> Caller:
    """The authenticated caller of the RPC being served; only valid inside a protected servicer method."""
    try:
        return _CALLER.get()
    except LookupError:
        raise RuntimeError("caller() used outside a call checked by TokenAuthInterceptor") from None


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, reason: str, label: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.label = label


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuse every non-public call without a valid token of this cluster (see ``auth.policy``).

    ``verifier`` may be a callable so a service whose keys change (auth rotating
    its signing key) always checks with the current one. ``account_check`` runs
    after the signature checks (auth re-reads the account: a token outlives a
    disabled or deleted one); ``admin_check`` replaces the default role check on
    admin methods.
    """

    def __init__(
        self,
        service: str,
        verifier: TokenVerifier | Callable[[], TokenVerifier],
        *,
        audit: AuditSink | None = None,
        account_check: AccountCheck | None = None,
        admin_check: AccountCheck | None = None,
    ) -> None:
        self._service = service
        self._verifier = verifier
        self._audit = audit
        self._account_check = account_check
        self._admin_check = admin_check

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or is_public(method):
            return handler
        return _wrap(handler, lambda context: self._check(method, context))

    async def _check(self, method: str, context: grpc.aio.ServicerContext) -> None:
        try:
            _CALLER.set(await self._authenticate(method, context.invocation_metadata()))
        except _Refused as refused:
            REFUSALS.labels(self._service, method.rsplit("/", 1)[-1], refused.label).inc()
            if self._audit is not None:
                await asyncio.to_thread(
                    self._audit.append,
                    "auth.refused",
                    outcome="refused",
                    details={"method": method, "reason": refused.reason, "peer": context.peer()},
                )
            await context.abort(refused.code, refused.reason)

    async def _authenticate(self, method: str, metadata: Any) -> Caller:
        token = bearer_token_from_metadata(metadata)
        if token is None:
            raise _Refused(grpc.StatusCode.UNAUTHENTICATED, "missing bearer token", "no-token")
        verifier = self._verifier if isinstance(self._verifier, TokenVerifier) else self._verifier()
        try:
            principal = verifier.verify(token)
        except AuthenticationError as exc:
            raise _Refused(grpc.StatusCode.UNAUTHENTICATED, f"invalid token: {exc}", "bad-token") from None
        if principal.job_id and not job_token_may_call(method):
            raise _Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"a job token acts only for job {principal.job_id}'s edges and batches, not {method}",
                "job-token",
            )
        if self._account_check is not None and (reason := await self._account_check(principal)):
            raise _Refused(grpc.StatusCode.UNAUTHENTICATED, reason, "account")
        if needs_admin(method):
            if self._admin_check is not None:
                reason = await self._admin_check(principal)
            elif principal.role != "admin":
                reason = f"this call requires an admin of cluster {principal.cluster_id}"
            else:
                reason = None
            if reason:
                raise _Refused(grpc.StatusCode.PERMISSION_DENIED, reason, "role")
        return Caller(principal, token)


Check = Callable[[grpc.aio.ServicerContext], Awaitable[None]]


def _wrap(handler: grpc.RpcMethodHandler, check: Check) -> grpc.RpcMethodHandler:
    """The same handler, with ``check`` awaited in the call's task before the servicer method runs.

    gRPC aio tells reader/writer-style methods (coroutines) from generator-style
    ones by the function's kind, so the wrapper keeps the kind of what it wraps.
    """
    if handler.request_streaming and handler.response_streaming:
        behavior, factory = handler.stream_stream, grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        behavior, factory = handler.stream_unary, grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        behavior, factory = handler.unary_stream, grpc.unary_stream_rpc_method_handler
    else:
        behavior, factory = handler.unary_unary, grpc.unary_unary_rpc_method_handler

    if inspect.isasyncgenfunction(behavior):

        async def checked_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await check(context)
            async for response in behavior(request, context):
                yield response

        wrapped: Callable[..., Any] = checked_stream
    else:

        async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await check(context)
            return await behavior(request, context)

        wrapped = checked
    return factory(
        wrapped,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
