"""gRPC surface of the auth service: maps requests onto the store, hasher and token issuer.

Blocking work (SQLite, argon2) runs in worker threads so one slow hash never
stalls other calls on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import NoReturn

import grpc
from argon2 import PasswordHasher

from nebula_common.auth.verifier import Principal, TokenVerifier
from nebula_common.errors import AuthenticationError, InvalidRequestError
from nebula_common.proto.nebula.v1 import auth_pb2, auth_pb2_grpc
from nebula_common.rpc import bearer_token_from_metadata
from services.auth import metrics
from services.auth.passwords import (
    DEFAULT_HASHER,
    MAX_PASSWORD_LENGTH,
    DummyHash,
    hash_password,
    needs_rehash,
    validate_new_account,
    verify_password,
)
from services.auth.store import AccountExistsError, AccountRecord, AccountStore
from services.auth.tokens import TokenIssuer

logger = logging.getLogger(__name__)

LOGIN_FAILED = "invalid username or password"
"""One message for every login failure, so callers cannot tell which names exist."""


class AuthServicer(auth_pb2_grpc.AuthServicer):
    def __init__(
        self,
        store: AccountStore,
        issuer: TokenIssuer,
        hasher: PasswordHasher = DEFAULT_HASHER,
    ) -> None:
        self._store = store
        self._issuer = issuer
        self._verifier: TokenVerifier = issuer.verifier()
        self._hasher = hasher
        self._dummy = DummyHash(hasher)
        self._jwks_json = _compact_json(issuer.jwks())

    async def CreateAccount(
        self, request: auth_pb2.CreateAccountRequest, context: grpc.aio.ServicerContext
    ) -> auth_pb2.Account:
        admin = await self._require_admin(context)
        # proto3 cannot tell "unset" from "": an omitted role means the least privileged one.
        role = request.role or "user"
        try:
            validate_new_account(request.username, request.password, role)
        except InvalidRequestError as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        password_hash = await asyncio.to_thread(hash_password, request.password, self._hasher)
        try:
            record = await asyncio.to_thread(self._store.create, request.username, password_hash, role)
        except AccountExistsError as exc:
            await _abort(context, grpc.StatusCode.ALREADY_EXISTS, str(exc))
        metrics.ACCOUNTS_CREATED.inc()
        logger.info(
            "account created",
            extra={
                "fields": {
                    "event": "account_created",
                    "cluster_id": self._issuer.cluster_id,
                    "username": record.username,
                    "role": record.role,
                    "created_by": admin.username,
                    "peer": context.peer(),
                }
            },
        )
        return self._account(record)

    async def Login(
        self, request: auth_pb2.LoginRequest, context: grpc.aio.ServicerContext
    ) -> auth_pb2.LoginResponse:
        username, password = request.username, request.password
        record, reason = await self._check_credentials(username, password)
        if record is None:
            metrics.LOGINS.labels(outcome="failure").inc()
            logger.warning(
                "login failed",
                extra={
                    "fields": {
                        "event": "login_failure",
                        "cluster_id": self._issuer.cluster_id,
                        "username": username[:64],
                        "reason": reason,
                        "peer": context.peer(),
                    }
                },
            )
            await _abort(context, grpc.StatusCode.UNAUTHENTICATED, LOGIN_FAILED)
        if needs_rehash(record.password_hash, self._hasher):
            # Upgrade hashes made with weaker parameters while we hold the plaintext.
            new_hash = await asyncio.to_thread(hash_password, password, self._hasher)
            await asyncio.to_thread(self._store.set_password_hash, record.username, new_hash)
        issued = self._issuer.issue(record.username, record.role)
        metrics.LOGINS.labels(outcome="success").inc()
        metrics.TOKENS_ISSUED.inc()
        logger.info(
            "login succeeded",
            extra={
                "fields": {
                    "event": "login_success",
                    "cluster_id": self._issuer.cluster_id,
                    "username": record.username,
                    "role": record.role,
                    "jti": issued.jti,
                    "expires_at": issued.expires_at,
                    "peer": context.peer(),
                }
            },
        )
        return auth_pb2.LoginResponse(token=issued.token, expires_at=issued.expires_at)

    async def VerifyToken(
        self, request: auth_pb2.VerifyTokenRequest, context: grpc.aio.ServicerContext
    ) -> auth_pb2.VerifyTokenResponse:
        try:
            principal = self._verifier.verify(request.token)
        except AuthenticationError as exc:
            return auth_pb2.VerifyTokenResponse(valid=False, reason=str(exc))
        except Exception:
            # The contract is "never raises": a verifier bug must still come back as "not valid".
            logger.exception("unexpected error verifying token")
            return auth_pb2.VerifyTokenResponse(valid=False, reason="internal error verifying token")
        return auth_pb2.VerifyTokenResponse(
            valid=True, username=principal.username, role=principal.role, cluster_id=principal.cluster_id
        )

    async def GetSigningKeys(
        self, request: auth_pb2.GetSigningKeysRequest, context: grpc.aio.ServicerContext
    ) -> auth_pb2.SigningKeys:
        return auth_pb2.SigningKeys(jwks_json=self._jwks_json, issuer=self._issuer.issuer)

    async def _check_credentials(self, username: str, password: str) -> tuple[AccountRecord | None, str]:
        """Return the account when the password matches, else None and a reason for the log only."""
        if not username or not password or len(password) > MAX_PASSWORD_LENGTH:
            return None, "malformed credentials"
        record = await asyncio.to_thread(self._store.get, username)
        if record is None or record.disabled:
            # Same argon2 work as a real check, so response time does not reveal the account exists.
            await asyncio.to_thread(self._dummy.verify, password)
            return None, "unknown user" if record is None else "account disabled"
        if not await asyncio.to_thread(verify_password, record.password_hash, password, self._hasher):
            return None, "wrong password"
        return record, ""

    async def _require_admin(self, context: grpc.aio.ServicerContext) -> Principal:
        token = bearer_token_from_metadata(context.invocation_metadata())
        if token is None:
            await _abort(context, grpc.StatusCode.UNAUTHENTICATED, "missing bearer token")
        try:
            principal = self._verifier.verify(token)
        except AuthenticationError as exc:
            await _abort(context, grpc.StatusCode.UNAUTHENTICATED, str(exc))
        # A token outlives a disabled or removed account; re-check the account itself.
        record = await asyncio.to_thread(self._store.get, principal.username)
        if record is None or record.disabled:
            await _abort(context, grpc.StatusCode.UNAUTHENTICATED, "account is disabled or no longer exists")
        if principal.role != "admin" or record.role != "admin":
            await _abort(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"creating accounts requires an admin of cluster {self._issuer.cluster_id}",
            )
        return principal

    def _account(self, record: AccountRecord) -> auth_pb2.Account:
        return auth_pb2.Account(
            username=record.username,
            role=record.role,
            cluster_id=self._issuer.cluster_id,
            created_at=record.created_at,
        )


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    """``context.abort`` typed as NoReturn so the code after it is known unreachable."""
    await context.abort(code, details)
    raise RuntimeError("context.abort returned instead of raising")


def _compact_json(document: dict[str, object]) -> str:
    return json.dumps(document, separators=(",", ":"), sort_keys=True)
