"""The audit signer (``nebula-signer``): seals other services' audit logs with keys they never read.

One gRPC server per log, each on its own Unix socket (``audit_signer.proto``), so the socket a call
arrives on names the log: a service reaches only its own (the deployment puts the socket in that
service's directory and nowhere else) and can seal only its own log. Each log's key and signed
position live in ``<data_dir>/<log>`` (``SealKeeper``), which no service can read. No TCP port, no
token: what guards each socket is who can reach its path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

import grpc

from nebula_common.audit.remote_signer import MAX_MESSAGE_BYTES, short_unix_target
from nebula_common.audit.seal_keeper import SealKeeper, SealRefused
from nebula_common.proto.nebula.v1 import audit_signer_pb2, audit_signer_pb2_grpc
from nebula_common.service.host import ServiceDefinition, Started
from services.signer.config import SignerSettings

log = logging.getLogger(__name__)

STOP_GRACE_SECONDS = 2.0
SOCKET_DIR_MODE = 0o711
SOCKET_MODE = 0o666
"""Open to whoever reaches it: the service's own directory above decides (``_private_socket``)."""


class SignerServicer(audit_signer_pb2_grpc.AuditSignerServicer):
    """One log's signer: its key, its position, every seal checked to extend it."""

    def __init__(self, name: str, keeper: SealKeeper) -> None:
        self.name = name
        self.keeper = keeper

    async def GetSealKey(
        self, request: audit_signer_pb2.GetSealKeyRequest, context: grpc.aio.ServicerContext
    ) -> audit_signer_pb2.SealKey:
        position = self.keeper.position
        return audit_signer_pb2.SealKey(
            key_id=self.keeper.signer.key_id,
            public_pem=self.keeper.signer.public_pem(),
            log_id=position.log_id,
            count=position.count,
            head=position.head,
        )

    async def SignSeal(
        self, request: audit_signer_pb2.SignSealRequest, context: grpc.aio.ServicerContext
    ) -> audit_signer_pb2.SealSignature:
        try:
            signature = await asyncio.to_thread(
                self.keeper.sign,
                request.log_id,
                request.count,
                request.head,
                request.ts,
                list(request.records),
            )
        except SealRefused as exc:
            log.warning("seal refused", extra={"fields": {"log": self.name, "reason": str(exc)}})
            code = grpc.StatusCode.INVALID_ARGUMENT if exc.malformed else grpc.StatusCode.FAILED_PRECONDITION
            await context.abort(code, f"log {self.name}: {exc}")
        return audit_signer_pb2.SealSignature(sig=signature, key_id=self.keeper.signer.key_id)


def _private_socket(path: Path) -> None:
    """The socket's directory (made here if missing) may be searched, not listed, by others; a socket
    left by a previous run is removed.

    Who may connect is decided one level up: each socket lies in its service's own directory (0700,
    the service's user's; ``launcher/signer.py``), and a boxed trainer runs as a user of its own
    (``launcher/userns.py``), which must reach a socket the signer, as root, made.
    """
    path.parent.mkdir(mode=SOCKET_DIR_MODE, parents=True, exist_ok=True)
    os.chmod(path.parent, SOCKET_DIR_MODE)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


async def start_signer(
    settings: SignerSettings, stack: contextlib.AsyncExitStack
) -> Started[list[grpc.aio.Server]]:
    """A keeper and a server per log; every socket listens before the ready line."""
    servers = []
    sockets = settings.socket_map()
    for name, path in sockets.items():
        keeper = await asyncio.to_thread(SealKeeper, settings.data_dir / name)
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        audit_signer_pb2_grpc.add_AuditSignerServicer_to_server(SignerServicer(name, keeper), server)
        _private_socket(path)
        directory, target = short_unix_target(path)  # a path of any length
        try:
            server.add_insecure_port(target)
            await server.start()
        finally:
            os.close(directory)
        os.chmod(path, SOCKET_MODE)
        stack.push_async_callback(server.stop, STOP_GRACE_SECONDS)
        servers.append(server)
        log.info(
            "sealing", extra={"fields": {"log": name, "socket": str(path), "key_id": keeper.signer.key_id}}
        )
    return Started(servers, {"logs": ",".join(sockets)})


SERVICE = ServiceDefinition("signer", SignerSettings, start_signer)
