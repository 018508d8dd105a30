"""The data service (``nebula-data``): each account's datasets, read by trainers through grants.

Like auth and the trainer it listens only on the cluster-internal network (plaintext gRPC, every
call carrying a token of this cluster); the switch is the only listener the other cluster reaches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from nebula_common.audit.servicer import AUDIT_SERVICE_NAME, add_audit_api
from nebula_common.auth.interceptor import TokenAuthInterceptor
from nebula_common.proto.nebula.v1 import data_pb2_grpc
from nebula_common.rpc import ServiceServer
from nebula_common.service.host import ServiceDefinition, Started
from nebula_common.service.identity import service_identity
from nebula_common.service.resources import (
    grpc_server,
    internal_server_options,
    service_audit,
    start_internal,
    token_verifier,
)
from services.data.config import DataSettings
from services.data.servicer import DataServicer
from services.data.store import DatasetStore

log = logging.getLogger(__name__)

SERVICE_NAME = "nebula.v1.Data"
STOP_GRACE_SECONDS = 5.0


async def start_data(settings: DataSettings, stack: contextlib.AsyncExitStack) -> Started[ServiceServer]:
    """Token keys, the dataset store and the audit log, then the server; released in reverse on stop."""
    identity = await service_identity(stack, settings, "data")
    verifier = await token_verifier(stack, settings.auth_address, settings.cluster_id, tls=identity.client)
    settings.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    store = await asyncio.to_thread(
        DatasetStore, settings.data_dir, max_dataset_bytes=settings.max_dataset_bytes
    )
    audit = await service_audit(
        stack,
        settings.data_dir,
        service="data",
        cluster=settings.cluster_id,
        signer=settings.audit_signer,
        # Each ReadBatch is audited; fsync at each seal keeps a batch from waiting on the disk.
        fsync_each=False,
    )
    server = grpc_server(
        stack,
        [SERVICE_NAME, AUDIT_SERVICE_NAME],
        grace=STOP_GRACE_SECONDS,
        interceptors=[*identity.interceptors(audit), TokenAuthInterceptor("data", verifier, audit=audit)],
        options=internal_server_options(),
    )
    data_pb2_grpc.add_DataServicer_to_server(
        DataServicer(store, audit, max_batch_examples=settings.max_batch_examples), server.server
    )
    add_audit_api(server, audit, "data", settings.cluster_id)
    ports = await start_internal(server, identity, settings, settings.listen)
    await asyncio.to_thread(audit.append, "data.start", details={"listen": settings.listen})
    log.info("data service started", extra={"fields": {"cluster_id": settings.cluster_id, **ports}})
    return Started(server, ports)


SERVICE = ServiceDefinition("data", DataSettings, start_data)
