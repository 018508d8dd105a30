"""Process entry point of the data service (``nebula-data``).

Like auth and the trainer it listens only on the cluster-internal network (plaintext gRPC, every
call carrying a token of this cluster); the switch is the only listener the other cluster reaches.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass

from pydantic import ValidationError

from nebula_common.audit import AuditLog, open_service_audit
from nebula_common.audit.servicer import AuditServicer
from nebula_common.auth import TokenVerifier
from nebula_common.logging import configure_logging
from nebula_common.proto.nebula.v1 import audit_pb2_grpc, data_pb2_grpc
from nebula_common.rpc import ServiceServer, create_server
from nebula_common.rpc.lifecycle import serve_until_signalled
from services.data.config import DataSettings
from services.data.servicer import DataServicer
from services.data.store import DatasetStore

log = logging.getLogger(__name__)

SERVICE_NAME = "nebula.v1.Data"
AUDIT_SERVICE_NAME = "nebula.v1.AuditLog"
AUTH_WAIT_S = 30.0
STOP_GRACE_SECONDS = 5.0


@dataclass
class DataServer(ServiceServer):
    """The data gRPC server plus the audit log it must seal when it stops."""

    audit: AuditLog | None = None
    verifier: TokenVerifier | None = None
    """Polls auth for keys and token revocations in the background; closed on stop."""

    @property
    def grpc_port(self) -> int:
        return self.ports["grpc"]

    async def stop(self, grace: float = 2.0) -> None:
        await super().stop(grace)
        if self.audit is not None:
            await asyncio.to_thread(self.audit.close)  # seals the tail
            self.audit = None
        if self.verifier is not None:
            await asyncio.to_thread(self.verifier.close)
            self.verifier = None


async def run_data_server(settings: DataSettings) -> DataServer:
    """Fetch token keys, open the store and the audit log, and start serving; caller owns ``stop()``."""
    verifier = await TokenVerifier.from_auth_service_async(
        settings.auth_address, settings.cluster_id, timeout=AUTH_WAIT_S
    )
    settings.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    store = await asyncio.to_thread(
        DatasetStore, settings.data_dir, max_dataset_bytes=settings.max_dataset_bytes
    )
    audit = await asyncio.to_thread(
        open_service_audit,
        settings.data_dir,
        service="data",
        cluster=settings.cluster_id,
        seal_interval_s=settings.audit_seal_interval_s,
        # Each ReadBatch is audited; fsync at each seal keeps a batch from waiting on the disk.
        fsync_each=False,
    )
    base = create_server([SERVICE_NAME, AUDIT_SERVICE_NAME])
    server = DataServer(
        server=base.server,
        health=base.health,
        service_names=base.service_names,
        audit=audit,
        verifier=verifier,
    )
    try:
        data_pb2_grpc.add_DataServicer_to_server(
            DataServicer(store, audit, verifier, max_batch_examples=settings.max_batch_examples),
            server.server,
        )
        audit_pb2_grpc.add_AuditLogServicer_to_server(
            AuditServicer(audit, verifier, "data", settings.cluster_id), server.server
        )
        server.add_insecure_port("grpc", settings.listen)
        server.start_metrics(settings.metrics_port, settings.listen)
        await server.start()
    except BaseException:
        await server.stop(0)
        raise
    audit.append("data.start", details={"listen": settings.listen})
    log.info(
        "data service started",
        extra={"fields": {"cluster_id": settings.cluster_id, "grpc_port": server.grpc_port}},
    )
    return server


async def _serve(settings: DataSettings) -> None:
    server = await run_data_server(settings)
    ready = {"service": "data", "grpc_port": server.grpc_port, "metrics_port": server.metrics_port}
    await serve_until_signalled(ready, lambda: server.stop(STOP_GRACE_SECONDS))


def main() -> None:
    try:
        settings = DataSettings()  # type: ignore[call-arg]  # filled from NEBULA_DATA_* variables
    except ValidationError as exc:
        sys.stderr.write(f"nebula-data: invalid configuration: {exc}\n")
        raise SystemExit(2) from None
    configure_logging("data", settings.log_level)
    try:
        asyncio.run(_serve(settings))
    except (RuntimeError, OSError, ValueError) as exc:
        log.error("data service failed", extra={"fields": {"error": str(exc)}})
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
