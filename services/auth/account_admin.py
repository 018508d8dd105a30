"""The account administration methods of the auth service: list, disable, enable, delete.

Admins only (``auth.policy`` lists the methods; the token interceptor checks the role). The last
enabled admin of a cluster can be neither disabled nor deleted, so a cluster never locks its
operator out; disabling or deleting an account revokes every token it holds, job tokens included.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, NoReturn

import grpc

from nebula_common.auth.verifier import Principal
from nebula_common.proto.nebula.v1 import auth_pb2
from services.auth.store import AccountRecord, AccountStore

if TYPE_CHECKING:
    from services.auth.tokens import TokenIssuer

__all__ = ["AccountAdminRpc", "abort"]


class AccountAdminRpc:
    """The account administration methods of ``AuthServicer`` (its store, issuer and audit log)."""

    # Provided by ``AuthServicer``, which this class is mixed into.
    _store: AccountStore
    _issuer: TokenIssuer
    _record: Callable[..., Awaitable[None]]
    _require_admin: Callable[[grpc.aio.ServicerContext], Awaitable[Principal]]
    _revoke_tokens: Callable[[str, str], Awaitable[None]]

    async def ListAccounts(
        self, request: auth_pb2.ListAccountsRequest, context: grpc.aio.ServicerContext
    ) -> auth_pb2.ListAccountsResponse:
        await self._require_admin(context)
        records = await asyncio.to_thread(self._store.list)
        return auth_pb2.ListAccountsResponse(accounts=[self._account(r) for r in records])

    async def _existing(self, username: str, context: grpc.aio.ServicerContext) -> AccountRecord:
        record = await asyncio.to_thread(self._store.get, username)
        if record is None:
            await abort(context, grpc.StatusCode.NOT_FOUND, f"no account {username!r}")
        return record

    async def _refuse_last_admin(self, record: AccountRecord, context: grpc.aio.ServicerContext) -> None:
        if (
            record.role == "admin"
            and not record.disabled
            and await asyncio.to_thread(self._store.count_admins) <= 1
        ):
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{record.username!r} is the last enabled admin of cluster {self._issuer.cluster_id}",
            )

    async def DisableAccount(
        self, request: auth_pb2.AccountRef, context: grpc.aio.ServicerContext
    ) -> auth_pb2.Account:
        admin = await self._require_admin(context)
        record = await self._existing(request.username, context)
        await self._refuse_last_admin(record, context)
        await asyncio.to_thread(self._store.set_disabled, record.username, True)
        await self._revoke_tokens(record.username, "account disabled")
        await self._record("account.disable", account=admin.username, details={"target": record.username})
        return self._account(await self._existing(record.username, context))

    async def EnableAccount(
        self, request: auth_pb2.AccountRef, context: grpc.aio.ServicerContext
    ) -> auth_pb2.Account:
        admin = await self._require_admin(context)
        record = await self._existing(request.username, context)
        await asyncio.to_thread(self._store.set_disabled, record.username, False)
        await self._record("account.enable", account=admin.username, details={"target": record.username})
        return self._account(await self._existing(record.username, context))

    async def DeleteAccount(
        self, request: auth_pb2.AccountRef, context: grpc.aio.ServicerContext
    ) -> auth_pb2.DeleteAccountResponse:
        admin = await self._require_admin(context)
        record = await self._existing(request.username, context)
        await self._refuse_last_admin(record, context)
        await asyncio.to_thread(self._store.delete, record.username)
        await self._revoke_tokens(record.username, "account deleted")
        await self._record("account.delete", account=admin.username, details={"target": record.username})
        return auth_pb2.DeleteAccountResponse()

    def _account(self, record: AccountRecord) -> auth_pb2.Account:
        return auth_pb2.Account(
            username=record.username,
            role=record.role,
            cluster_id=self._issuer.cluster_id,
            created_at=record.created_at,
            disabled=record.disabled,
            locked_until=record.locked_until if record.locked() else 0,
        )


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    """``context.abort`` typed as NoReturn so the code after it is known unreachable."""
    await context.abort(code, details)
    raise RuntimeError("context.abort returned instead of raising")
