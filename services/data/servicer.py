"""The ``nebula.v1.Data`` servicer: who may do what with a dataset, decided here, audited here.

Rules (the proto file says the same to clients):

* the caller is the subject of a token of THIS cluster, verified locally;
* the owner of a dataset is part of its reference, so an operation names whose dataset it touches;
  upload, import, delete, download, grant, revoke and listing grants only ever act on the caller's
  own namespace;
* another account's dataset is NOT_FOUND unless the caller holds an active grant on it, and a grant
  only ever allows ``ReadBatch`` (records by id), never the file;
* every decision, allowed or refused, becomes an audit record; an audit write that fails fails the
  call, since an access that cannot be recorded must not happen.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, NoReturn, TypeVar

import grpc

from nebula_common.audit import AuditLog
from nebula_common.auth import Principal
from nebula_common.auth.interceptor import caller as current_caller
from nebula_common.errors import AuthenticationError, InvalidRequestError, NebulaError, PermissionDeniedError
from nebula_common.proto.nebula.v1 import data_pb2, data_pb2_grpc
from services.data import metrics
from services.data.store import (
    DatasetExistsError,
    DatasetInfo,
    DatasetNotFoundError,
    DatasetStore,
    GrantRecord,
    check_name,
)

log = logging.getLogger(__name__)
_T = TypeVar("_T")

MAX_UPLOAD_CHUNK = 4 * 1024 * 1024
_STATUS: dict[type[NebulaError], grpc.StatusCode] = {
    DatasetNotFoundError: grpc.StatusCode.NOT_FOUND,
    DatasetExistsError: grpc.StatusCode.ALREADY_EXISTS,
    PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
    AuthenticationError: grpc.StatusCode.UNAUTHENTICATED,
    InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
}


def _status_for(exc: NebulaError) -> grpc.StatusCode:
    for kind, code in _STATUS.items():
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def _dataset_proto(info: DatasetInfo) -> data_pb2.Dataset:
    return data_pb2.Dataset(
        owner=info.owner,
        name=info.name,
        records=info.records,
        size_bytes=info.size_bytes,
        sha256=info.sha256,
        created_at=info.created_at,
    )


def _grant_proto(grant: GrantRecord) -> data_pb2.GrantInfo:
    return data_pb2.GrantInfo(
        owner=grant.owner,
        name=grant.name,
        grantee=grant.grantee,
        granted_at=grant.granted_at,
        expires_at=grant.expires_at,
    )


class DataServicer(data_pb2_grpc.DataServicer):
    def __init__(
        self,
        store: DatasetStore,
        audit: AuditLog,
        *,
        max_batch_examples: int,
    ) -> None:
        self._store = store
        self._audit = audit
        self._max_batch_examples = max_batch_examples

    # ------------------------------------------------------------------ plumbing
    async def _record(self, event: str, *, outcome: str = "ok", account: str = "", **details: Any) -> None:
        await asyncio.to_thread(self._audit.append, event, outcome=outcome, account=account, details=details)

    @staticmethod
    async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
        await context.abort(code, details)
        raise AssertionError("context.abort returned instead of raising")

    async def _run(
        self,
        context: grpc.aio.ServicerContext,
        method: str,
        caller: Principal,
        target: dict[str, str],
        action: Callable[[], _T],
        details: Callable[[_T], dict[str, Any]] | None = None,
    ) -> _T:
        """Run ``action`` in a worker thread; audit its outcome; map domain errors to status codes."""
        try:
            result = await asyncio.to_thread(action)
        except NebulaError as exc:
            code = _status_for(exc)
            outcome = (
                "refused"
                if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED)
                else ("failure")
            )
            metrics.REQUESTS.labels(method, outcome).inc()
            await self._record(
                f"data.{method}", outcome=outcome, account=caller.username, **target, reason=str(exc)
            )
            await self._abort(context, code, str(exc))
        metrics.REQUESTS.labels(method, "ok").inc()
        await self._record(
            f"data.{method}", account=caller.username, **target, **(details(result) if details else {})
        )
        return result

    def _visible_for_reading(self, caller: str, owner: str, name: str) -> None:
        """NOT_FOUND unless the caller owns the dataset or holds an active grant on it."""
        check_name(name, "dataset name")
        check_name(owner, "dataset owner")
        self._store.require(owner, name)
        if not self._store.may_read(owner, name, caller):
            raise DatasetNotFoundError(f"no dataset {owner}/{name} visible to this account")

    def _own(self, caller: str, ref: data_pb2.DatasetRef, operation: str) -> tuple[str, str]:
        """(owner, name) of a dataset the caller must own; a grantee learns why, others get NOT_FOUND."""
        owner = ref.owner or caller
        check_name(ref.name, "dataset name")
        check_name(owner, "dataset owner")
        if owner != caller:
            if self._store.get(owner, ref.name) is not None and self._store.may_read(owner, ref.name, caller):
                raise PermissionDeniedError(
                    f"only {owner} may {operation} dataset {owner}/{ref.name}; a grant allows ReadBatch only"
                )
            raise DatasetNotFoundError(f"no dataset {owner}/{ref.name} visible to this account")
        self._store.require(owner, ref.name)
        return owner, ref.name

    # ------------------------------------------------------------------ datasets
    async def UploadDataset(
        self,
        request_iterator: AsyncIterator[data_pb2.UploadDatasetRequest],
        context: grpc.aio.ServicerContext,
    ) -> data_pb2.Dataset:
        caller = current_caller().principal
        first = await context.read()
        if first is grpc.aio.EOF or first.WhichOneof("body") != "header":
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "the first message must be 'header'")
        name = first.header.name
        loop = asyncio.get_running_loop()

        def chunks() -> Iterator[bytes]:
            # Runs in the worker thread: pull each message from the event loop as the store consumes it,
            # so an upload streams to disk without holding the dataset in memory.
            while True:
                message = asyncio.run_coroutine_threadsafe(context.read(), loop).result()
                if message is grpc.aio.EOF:
                    return
                if message.WhichOneof("body") != "chunk":
                    raise InvalidRequestError("only 'chunk' messages may follow the header")
                if len(message.chunk) > MAX_UPLOAD_CHUNK:
                    raise InvalidRequestError(f"upload chunks must be at most {MAX_UPLOAD_CHUNK} bytes")
                yield message.chunk

        def create() -> DatasetInfo:
            check_name(name, "dataset name")
            return self._store.create(caller.username, name, chunks())

        info = await self._run(
            context,
            "upload",
            caller,
            {"dataset": f"{caller.username}/{name}"},
            create,
            lambda i: {"records": i.records, "size_bytes": i.size_bytes, "sha256": i.sha256},
        )
        return _dataset_proto(info)

    async def ImportDataset(
        self, request: data_pb2.ImportDatasetRequest, context: grpc.aio.ServicerContext
    ) -> data_pb2.Dataset:
        caller = current_caller().principal

        def create() -> DatasetInfo:
            check_name(request.name, "dataset name")
            return self._store.import_from_inbox(caller.username, request.name, request.inbox_path)

        info = await self._run(
            context,
            "import",
            caller,
            {"dataset": f"{caller.username}/{request.name}", "inbox_path": request.inbox_path},
            create,
            lambda i: {"records": i.records, "size_bytes": i.size_bytes, "sha256": i.sha256},
        )
        return _dataset_proto(info)

    async def ListDatasets(
        self, request: data_pb2.ListDatasetsRequest, context: grpc.aio.ServicerContext
    ) -> data_pb2.ListDatasetsResponse:
        caller = current_caller().principal

        def listing() -> tuple[list[DatasetInfo], list[DatasetInfo]]:
            return self._store.list_owned(caller.username), self._store.list_granted_to(caller.username)

        owned, granted = await self._run(
            context, "list", caller, {}, listing, lambda r: {"owned": len(r[0]), "granted": len(r[1])}
        )
        return data_pb2.ListDatasetsResponse(
            owned=[_dataset_proto(i) for i in owned], granted=[_dataset_proto(i) for i in granted]
        )

    async def DeleteDataset(
        self, request: data_pb2.DatasetRef, context: grpc.aio.ServicerContext
    ) -> data_pb2.DeleteDatasetResponse:
        caller = current_caller().principal

        def delete() -> None:
            owner, name = self._own(caller.username, request, "delete")
            self._store.delete(owner, name)

        await self._run(context, "delete", caller, {"dataset": _label(request, caller)}, delete)
        return data_pb2.DeleteDatasetResponse()

    async def DownloadDataset(
        self, request: data_pb2.DatasetRef, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[data_pb2.DownloadChunk]:
        caller = current_caller().principal
        owner, name = await self._run(
            context,
            "download",
            caller,
            {"dataset": _label(request, caller)},
            lambda: self._own(caller.username, request, "download"),
        )
        content = self._store.iter_content(owner, name)
        try:
            while (chunk := await asyncio.to_thread(next, content, None)) is not None:
                yield data_pb2.DownloadChunk(data=chunk)
        finally:
            content.close()

    # ------------------------------------------------------------------ grants
    async def Grant(
        self, request: data_pb2.GrantRequest, context: grpc.aio.ServicerContext
    ) -> data_pb2.GrantInfo:
        caller = current_caller().principal
        target = {"dataset": f"{caller.username}/{request.name}", "grantee": request.grantee}

        def grant() -> GrantRecord:
            check_name(request.name, "dataset name")
            return self._store.grant(caller.username, request.name, request.grantee, request.expires_at)

        record = await self._run(
            context, "grant", caller, target, grant, lambda g: {"expires_at": g.expires_at}
        )
        return _grant_proto(record)

    async def Revoke(
        self, request: data_pb2.RevokeRequest, context: grpc.aio.ServicerContext
    ) -> data_pb2.RevokeResponse:
        caller = current_caller().principal
        target = {"dataset": f"{caller.username}/{request.name}", "grantee": request.grantee}

        def revoke() -> bool:
            check_name(request.name, "dataset name")
            return self._store.revoke(caller.username, request.name, request.grantee)

        revoked = await self._run(context, "revoke", caller, target, revoke, lambda r: {"revoked": r})
        return data_pb2.RevokeResponse(revoked=revoked)

    async def ListGrants(
        self, request: data_pb2.DatasetRef, context: grpc.aio.ServicerContext
    ) -> data_pb2.ListGrantsResponse:
        caller = current_caller().principal

        def listing() -> list[GrantRecord]:
            owner, name = self._own(caller.username, request, "list the grants of")
            return sorted(self._store.grants(owner, name).values(), key=lambda g: g.grantee)

        grants = await self._run(
            context,
            "list_grants",
            caller,
            {"dataset": _label(request, caller)},
            listing,
            lambda g: {"grants": len(g)},
        )
        return data_pb2.ListGrantsResponse(grants=[_grant_proto(g) for g in grants])

    # ------------------------------------------------------------------ the grantee's interface
    async def ReadBatch(
        self, request: data_pb2.ReadBatchRequest, context: grpc.aio.ServicerContext
    ) -> data_pb2.Batch:
        caller = current_caller().principal
        owner = request.dataset.owner or caller.username
        name = request.dataset.name
        ids = list(request.example_ids)
        target = {"dataset": f"{owner}/{name}"}

        def read() -> list[bytes]:
            if not ids:
                raise InvalidRequestError("example_ids must not be empty")
            if len(ids) > self._max_batch_examples:
                raise InvalidRequestError(
                    f"{len(ids)} example ids requested; at most {self._max_batch_examples} per batch"
                )
            self._visible_for_reading(caller.username, owner, name)
            return self._store.read(owner, name, ids)

        def summary(records: list[bytes]) -> dict[str, Any]:
            # What was read, compactly: how many, which ids (by digest) and whether a grant allowed it.
            id_digest = hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]
            return {
                "examples": len(records),
                "bytes": sum(len(r) for r in records),
                "ids_sha256": id_digest,
                "via_grant": owner != caller.username,
            }

        records = await self._run(context, "read", caller, target, read, summary)
        metrics.RECORDS_READ.inc(len(records))
        return data_pb2.Batch(records_json=[r.decode() for r in records])


def _label(ref: data_pb2.DatasetRef, caller: Principal) -> str:
    return f"{ref.owner or caller.username}/{ref.name}"
