"""Trainer process: the control API of one cluster's compute, running stages on threads."""

from __future__ import annotations

import asyncio
import logging
import sys

import torch

from nebula_common.audit import open_service_audit
from nebula_common.audit.servicer import AuditServicer
from nebula_common.auth import TokenVerifier
from nebula_common.logging import configure_logging
from nebula_common.proto.nebula.v1 import audit_pb2, audit_pb2_grpc, trainer_pb2_grpc
from nebula_common.rpc import ServiceServer, create_server
from nebula_common.rpc.lifecycle import serve_until_signalled
from services.trainer.config import TrainerSettings
from services.trainer.servicer import TrainerServicer

log = logging.getLogger(__name__)
AUTH_WAIT_S = 30.0
AUDIT_SERVICE_NAME = audit_pb2.DESCRIPTOR.services_by_name["AuditLog"].full_name


async def run_trainer(settings: TrainerSettings) -> tuple[ServiceServer, TrainerServicer]:
    torch.set_num_threads(settings.torch_threads)
    verifier = await TokenVerifier.from_auth_service_async(
        settings.auth_address, settings.cluster_id, timeout=AUTH_WAIT_S
    )
    data_dir = settings.resolved_data_dir()
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Submits and stage starts/stops are rare: fsync each record so none is lost in a crash.
    audit = await asyncio.to_thread(
        open_service_audit, data_dir, service="trainer", cluster=settings.cluster_id
    )
    service = create_server(["nebula.v1.Trainer", AUDIT_SERVICE_NAME])
    servicer = TrainerServicer(
        settings.cluster_id,
        verifier,
        settings.switch_address,
        data_dir,
        audit,
        data_service_address=settings.data_service_address,
    )
    trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, service.server)
    audit_pb2_grpc.add_AuditLogServicer_to_server(
        AuditServicer(audit, verifier, "trainer", settings.cluster_id), service.server
    )
    service.add_insecure_port("grpc", settings.listen)
    await service.start()
    service.start_metrics(settings.metrics_port, settings.listen)
    return service, servicer


async def _serve(settings: TrainerSettings) -> None:
    service, servicer = await run_trainer(settings)

    async def stop() -> None:
        for runner in servicer.runners.values():
            runner.cancel()
        await service.stop()
        for runner in servicer.runners.values():
            await asyncio.to_thread(runner.join, 10.0)
        await asyncio.to_thread(servicer.audit.close)  # seals the tail of the log

    ready = {
        "service": "trainer",
        "cluster_id": settings.cluster_id,
        "grpc_port": service.ports["grpc"],
        "metrics_port": service.metrics_port,
    }
    await serve_until_signalled(ready, stop)


def main() -> None:
    try:
        settings = TrainerSettings()
    except Exception as exc:
        print(f"nebula-trainer: invalid configuration:\n{exc}", file=sys.stderr)
        sys.exit(2)
    configure_logging("trainer", settings.log_level)
    asyncio.run(_serve(settings))


if __name__ == "__main__":
    main()
