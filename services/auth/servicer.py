"""gRPC surface of the auth service: maps requests onto the store, hasher and token issuer.

Blocking work (SQLite, argon2) runs in worker threads so one slow hash never
stalls other calls on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time

import grpc
from argon2 import PasswordHasher

from nebula_common.audit import AuditLog
from nebula_common.auth.interceptor import caller as current_caller
from nebula_common.auth.verifier import LEEWAY_SECONDS, KeySnapshot, Principal, Revocation, TokenVerifier
from nebula_common.errors import AuthenticationError, InvalidRequestError
from nebula_common.proto.nebula.v1 import auth_pb2, auth_pb2_grpc
from services.auth import metrics
from services.auth.account_admin import AccountAdminRpc, abort
from services.auth.job_tokens import JobTokenRpc
from services.auth.passwords import (
    DEFAULT_HASHER,
    MAX_PASSWORD_LENGTH,
    DummyHash,
    hash_password,
    needs_rehash,
    validate_new_account,
    validate_password,
    verify_password,
)
from services.auth.store import AccountExistsError, AccountRecord, AccountStore, TokenRevocationRecord
from services.auth.tokens import TokenIssuer

logger = logging.getLogger(__name__)

LOGIN_FAILED = "invalid username or password"
"""One message for every login failure, so callers cannot tell which names exist."""


class AuthServicer(AccountAdminRpc, JobTokenRpc, auth_pb2_grpc.AuthServicer):
    def __init__(
        self,
        store: AccountStore,
        issuer: TokenIssuer,
        audit: AuditLog,
        hasher: PasswordHasher = DEFAULT_HASHER,
        *,
        max_failed_logins: int = 5,
        lockout_seconds: int = 300,
    ) -> None:
        self._max_failed_logins = max_failed_logins
        self._lockout_seconds = lockout_seconds
        self._store = store
        self._audit = audit
        self._issuer = issuer
        self._verifier: TokenVerifier = issuer.verifier()
        self._hasher = hasher
        self._dummy = DummyHash(hasher)
        self._sync_verifier()

    def _revocations(self) -> tuple[int, list[TokenRevocationRecord]]:
        """Revocations that still cover unexpired tokens (blocking: SQLite)."""
        return self._store.revocations(horizon_s=self._issuer.ttl_seconds + LEEWAY_SECONDS)

    def _sync_verifier(self) -> None:
        """Give this service's own verifier the current keys and revocations (blocking: SQLite).

        The auth service enforces revocations on its own calls (VerifyToken, ChangePassword)
        exactly like the switch, trainer and data service, just without the polling delay.
        """
        epoch, entries = self._revocations()
        snapshot = KeySnapshot(
            _compact_json(self._issuer.jwks()),
            epoch,
            {e.username: Revocation(e.not_before_ms, e.reason) for e in entries},
        )
        try:
            self._verifier.apply(snapshot)
        except ValueError:
            # A concurrent revocation already applied a newer epoch, which includes this one.
            logger.debug("own verifier already at a newer revocation epoch than %d", epoch)

    async def _revoke_tokens(self, username: str, reason: str) -> None:
        """Invalidate every token of ``username`` issued until now, here and (within seconds) everywhere."""
        epoch = await asyncio.to_thread(self._store.revoke_tokens, username, reason)
        await asyncio.to_thread(self._sync_verifier)
        await self._record("token.revoke", account=username, details={"reason": reason, "epoch": epoch})

    def current_verifier(self) -> TokenVerifier:
        """The verifier for this service's own tokens (it changes when signing keys rotate)."""
        return self._verifier

    async def CreateAccount(
        self, request: auth_pb2.CreateAccountRequest, context: grpc.aio.ServicerContext
    ) -> auth_pb2.Account:
        admin = await self._require_admin(context)
        # proto3 cannot tell "unset" from "": an omitted role means the least privileged one.
        role = request.role or "user"
        try:
            validate_new_account(request.username, request.password, role)
        except InvalidRequestError as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        password_hash = await asyncio.to_thread(hash_password, request.password, self._hasher)
        try:
            record = await asyncio.to_thread(self._store.create, request.username, password_hash, role)
        except AccountExistsError as exc:
            await abort(context, grpc.StatusCode.ALREADY_EXISTS, str(exc))
        metrics.ACCOUNTS_CREATED.inc()
        await self._record(
            "account.create", account=admin.username, details={"target": record.username, "role": record.role}
        )
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
            await self._record(
                "login",
                outcome="failure",
                account=username[:64],
                details={"reason": reason, "peer": context.peer()},
            )
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
            await abort(context, grpc.StatusCode.UNAUTHENTICATED, LOGIN_FAILED)
        await self._wait_past_revocation(record.username)
        if needs_rehash(record.password_hash, self._hasher):
            # Upgrade hashes made with weaker parameters while we hold the plaintext.
            new_hash = await asyncio.to_thread(hash_password, password, self._hasher)
            await asyncio.to_thread(self._store.set_password_hash, record.username, new_hash)
        issued = self._issuer.issue(record.username, record.role)
        await self._record(
            "login",
            account=record.username,
            details={"role": record.role, "jti": issued.jti, "kid": self._issuer.kid, "peer": context.peer()},
        )
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

    async def _wait_past_revocation(self, username: str) -> None:
        """Delay a login until its token's whole-second ``iat`` is not caught by a fresh revocation.

        Tokens carry ``iat`` in whole seconds, so a token issued in the same second as a
        revocation (re-enabled account, new password) would look older than it; waiting for the
        next second (at most one, and only right after a revocation) keeps the new token valid.
        """
        _, entries = await asyncio.to_thread(self._revocations)
        for entry in entries:
            if entry.username == username:
                delay = math.ceil(entry.not_before_ms / 1000) - time.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                return

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
        # Recomputed per call: rotation adds keys, and retired keys drop out after a token lifetime;
        # likewise revocations older than a token lifetime drop out (they cover only expired tokens).
        epoch, entries = await asyncio.to_thread(self._revocations)
        return auth_pb2.SigningKeys(
            jwks_json=_compact_json(self._issuer.jwks()),
            issuer=self._issuer.issuer,
            revocation_epoch=epoch,
            revocations=[
                auth_pb2.TokenRevocation(username=e.username, not_before_ms=e.not_before_ms, reason=e.reason)
                for e in entries
            ],
        )

    async def _check_credentials(self, username: str, password: str) -> tuple[AccountRecord | None, str]:
        """Return the account when the password matches, else None and a reason for the log only."""
        if not username or not password or len(password) > MAX_PASSWORD_LENGTH:
            return None, "malformed credentials"
        record = await asyncio.to_thread(self._store.get, username)
        if record is None or record.disabled or record.locked():
            # Same argon2 work as a real check, so response time does not reveal the account exists
            # (or that it is locked: a locked account must not become a password oracle either).
            await asyncio.to_thread(self._dummy.verify, password)
            if record is None:
                return None, "unknown user"
            return None, "account disabled" if record.disabled else "account locked"
        if not await asyncio.to_thread(verify_password, record.password_hash, password, self._hasher):
            updated = await asyncio.to_thread(
                self._store.record_failure,
                username,
                max_failures=self._max_failed_logins,
                lockout_seconds=self._lockout_seconds,
            )
            if updated is not None and updated.locked() and updated.failed_logins == self._max_failed_logins:
                await self._record(
                    "account.lock",
                    outcome="refused",
                    account=username,
                    details={"failed_logins": updated.failed_logins, "locked_until": updated.locked_until},
                )
            return None, "wrong password"
        if record.failed_logins:
            await asyncio.to_thread(self._store.record_success, username)
        return record, ""

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> tuple[Principal, AccountRecord]:
        """The verified caller (see ``account_check``) and their account record, re-read for this call."""
        principal = current_caller().principal
        record = await asyncio.to_thread(self._store.get, principal.username)
        if record is None or record.disabled:  # disabled or deleted since the interceptor looked
            await abort(context, grpc.StatusCode.UNAUTHENTICATED, "account is disabled or no longer exists")
        return principal, record

    async def account_check(self, principal: Principal) -> str | None:
        """Interceptor hook: a token outlives a disabled or deleted account, so re-read the account."""
        record = await asyncio.to_thread(self._store.get, principal.username)
        if record is None or record.disabled:
            return "account is disabled or no longer exists"
        return None

    async def admin_check(self, principal: Principal) -> str | None:
        """Interceptor hook for admin methods: the token's role and the account's current role must agree."""
        record = await asyncio.to_thread(self._store.get, principal.username)
        if principal.role != "admin" or record is None or record.role != "admin":
            return f"this call requires an admin of cluster {self._issuer.cluster_id}"
        return None

    async def ChangePassword(
        self, request: auth_pb2.ChangePasswordRequest, context: grpc.aio.ServicerContext
    ) -> auth_pb2.Account:
        principal, caller = await self._authenticate(context)
        is_admin = principal.role == "admin" and caller.role == "admin"
        if principal.username != request.username and not is_admin:
            # Another account's existence is not the caller's business: same answer as a missing one.
            await abort(context, grpc.StatusCode.NOT_FOUND, f"no account {request.username!r}")
        target = await self._existing(request.username, context)
        try:
            validate_password(request.new_password)
        except InvalidRequestError as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if principal.username == request.username and not is_admin:
            ok = await asyncio.to_thread(
                verify_password,
                target.password_hash,
                request.current_password[:MAX_PASSWORD_LENGTH],
                self._hasher,
            )
            if not ok:
                await self._record(
                    "account.password",
                    outcome="failure",
                    account=principal.username,
                    details={"target": target.username, "reason": "wrong current password"},
                )
                await abort(context, grpc.StatusCode.PERMISSION_DENIED, "current password is wrong")
        new_hash = await asyncio.to_thread(hash_password, request.new_password, self._hasher)
        await asyncio.to_thread(self._store.set_password_hash, target.username, new_hash)
        # Whoever held the old password may hold a token from it: those tokens end here.
        await self._revoke_tokens(target.username, "password changed")
        await self._record(
            "account.password", account=principal.username, details={"target": target.username}
        )
        return self._account(await self._existing(target.username, context))

    async def RotateSigningKey(
        self, request: auth_pb2.RotateSigningKeyRequest, context: grpc.aio.ServicerContext
    ) -> auth_pb2.RotateSigningKeyResponse:
        admin = await self._require_admin(context)
        old_kid, new_kid = await asyncio.to_thread(self._issuer.rotate)
        self._verifier = self._issuer.verifier()
        await asyncio.to_thread(self._sync_verifier)
        await self._record(
            "token.key_rotate", account=admin.username, details={"old_kid": old_kid, "new_kid": new_kid}
        )
        return auth_pb2.RotateSigningKeyResponse(old_kid=old_kid, new_kid=new_kid)

    async def _require_admin(self, context: grpc.aio.ServicerContext) -> Principal:
        """The admin the token interceptor verified (admin methods are listed in ``auth.policy``)."""
        return current_caller().principal

    async def _record(
        self, event: str, *, outcome: str = "ok", account: str = "", details: dict[str, object] | None = None
    ) -> None:
        """Append to the audit log off the event loop (the write is fsynced)."""
        await asyncio.to_thread(self._audit.append, event, outcome=outcome, account=account, details=details)


def _compact_json(document: dict[str, object]) -> str:
    return json.dumps(document, separators=(",", ":"), sort_keys=True)
