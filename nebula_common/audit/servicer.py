"""The admin-only ``nebula.v1.AuditLog`` gRPC API, served by every service that keeps a log.

Only admins of this cluster may read the log: it names accounts, jobs and peers, which is exactly
what one tenant must not learn about another. The file read runs in a worker thread so a large
log never stalls the service's event loop (on the switch, that loop relays training traffic).
"""

from __future__ import annotations

import asyncio
import json
from typing import NoReturn

import grpc

from nebula_common.audit.log import AuditLog
from nebula_common.audit.query import DEFAULT_LIMIT, MAX_LIMIT, AuditFilter, query_log
from nebula_common.auth.interceptor import caller
from nebula_common.auth.verifier import Principal
from nebula_common.proto.nebula.v1 import audit_pb2, audit_pb2_grpc
from nebula_common.rpc.server import ServiceServer

__all__ = ["AuditServicer"]


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    await context.abort(code, details)
    raise RuntimeError("context.abort returned instead of raising")


class AuditServicer(audit_pb2_grpc.AuditLogServicer):
    """Both methods are admin-only (``nebula_common.auth.policy``): the token interceptor enforces it."""

    def __init__(self, audit: AuditLog, service: str, cluster_id: str) -> None:
        self._audit = audit
        self._service = service
        self._cluster_id = cluster_id

    async def _require_admin(self, context: grpc.aio.ServicerContext) -> Principal:
        return caller().principal

    async def Query(
        self, request: audit_pb2.AuditQuery, context: grpc.aio.ServicerContext
    ) -> audit_pb2.AuditRecords:
        principal = await self._require_admin(context)
        limit = request.limit or DEFAULT_LIMIT
        if limit > MAX_LIMIT:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"limit must be at most {MAX_LIMIT}")
        if request.since_unix < 0 or request.until_unix < 0:
            await _abort(
                context, grpc.StatusCode.INVALID_ARGUMENT, "since_unix/until_unix must not be negative"
            )
        where = AuditFilter(
            account=request.account,
            job_id=request.job_id,
            event=request.event,
            since_unix=request.since_unix,
            until_unix=request.until_unix,
        )
        result = await asyncio.to_thread(query_log, self._audit.path, where, limit)
        # Reading the log is itself security-relevant: who looked, and for what.
        await asyncio.to_thread(
            self._audit.append,
            "audit.query",
            account=principal.username,
            details={
                "filter": {k: v for k, v in where.__dict__.items() if v},
                "returned": len(result.records),
            },
        )
        return audit_pb2.AuditRecords(
            records_json=[json.dumps(r, sort_keys=True, separators=(",", ":")) for r in result.records],
            truncated=result.truncated,
            total_records=result.total_records,
        )

    async def GetAuditKey(
        self, request: audit_pb2.GetAuditKeyRequest, context: grpc.aio.ServicerContext
    ) -> audit_pb2.AuditKey:
        await self._require_admin(context)
        return audit_pb2.AuditKey(
            public_key_pem=self._audit.public_pem().decode(),
            key_id=self._audit.key_id,
            log_id=self._audit.log_id,
            service=self._service,
            cluster_id=self._cluster_id,
        )


AUDIT_SERVICE_NAME = audit_pb2.DESCRIPTOR.services_by_name["AuditLog"].full_name
"""The name every service that keeps a log serves its ``AuditLog`` API under."""


def add_audit_api(server: ServiceServer, audit: AuditLog, service: str, cluster_id: str) -> None:
    """Serve ``audit`` read-only to this cluster's admins on ``server`` (list AUDIT_SERVICE_NAME too).

    The health of ``AUDIT_SERVICE_NAME`` is the log's: NOT_SERVING while records cannot be written
    (operations that must be audited fail meanwhile), SERVING again once they can.
    """
    audit_pb2_grpc.add_AuditLogServicer_to_server(AuditServicer(audit, service, cluster_id), server.server)
    server.follow(AUDIT_SERVICE_NAME, audit.watch)
