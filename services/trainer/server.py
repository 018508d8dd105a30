"""The trainer service (``nebula-trainer``): the control API of one cluster's compute.

Each stage runs in a confined process of its own (``stage_process``, ``sandbox``), never in this one,
which holds the cluster's service identity and every running job's token. Each is recorded on disk
(``records.py``), so after a crash or ``kill -9`` (which takes the stage processes with it) the
restarted process resumes them before it serves (``restore.py``). On stop, stage processes are
drained (left for the next start to resume, as after a kill) and in-process stages cancelled, all
joined (within ``stop_grace_s``) before the audit log is sealed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import torch

from nebula_common.audit.servicer import AUDIT_SERVICE_NAME, add_audit_api
from nebula_common.auth.interceptor import TokenAuthInterceptor
from nebula_common.proto.nebula.v1 import trainer_pb2_grpc
from nebula_common.rpc.edge_tls import TLS, edge_address
from nebula_common.rpc.internal_tls import InternalTlsError
from nebula_common.service.host import ServiceDefinition, Started
from nebula_common.service.identity import ServiceIdentity, service_identity
from nebula_common.service.resources import (
    grpc_server,
    internal_server_options,
    service_audit,
    start_internal,
    token_verifier,
)
from services.trainer import landlock
from services.trainer.config import TrainerSettings
from services.trainer.edge import EdgeSettings
from services.trainer.job_tokens import JobTokens
from services.trainer.rank_accounts import RankAccounts
from services.trainer.restore import restore_stages
from services.trainer.retention import FinishedStages
from services.trainer.runtime.rank_gate import RankTls
from services.trainer.runtime.rank_sources import ClusterRanks
from services.trainer.sandbox import StageLimits, choose_confinement
from services.trainer.servicer import TrainerServicer

EDGE_SETTING = "NEBULA_TRAINER_SWITCH_EDGE_SOCKET"

log = logging.getLogger(__name__)
STOP_GRACE_SECONDS = 2.0


def _stop_stages(servicer: TrainerServicer, grace: float) -> None:
    """Drain every stage process, cancel the rest, then wait (``grace`` seconds in all) for them.

    A trainer that stops (``nebula local down``, a rolling restart, SIGTERM) does not end its jobs: a
    stage process is drained (``StageProcess.drain``: killed, its record left running) and the next
    start of this trainer resumes it, its peer waiting meanwhile as for a killed trainer. Cancelling a
    job is ``nebula job cancel``. Stages in the trainer itself (cluster ranks) are cancelled: a
    stage thread stores its end in its record before it exits, so a restart shows how each ended.
    """
    runners = list(servicer.runners.values())
    for runner in runners:
        drain = getattr(runner, "drain", None)
        if drain is not None:
            drain()
        else:
            runner.cancel()
    deadline = time.monotonic() + grace
    for runner in runners:
        runner.join(max(0.0, deadline - time.monotonic()))


async def _cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _cluster_ranks(
    settings: TrainerSettings, identity: ServiceIdentity, stack: contextlib.AsyncExitStack
) -> ClusterRanks | None:
    """The rank store of cluster ranks, behind mutual TLS with this trainer's identity (``rank_gate``)."""
    if settings.ranks_listen is None or settings.ranks is None:
        return None
    tls = (
        RankTls(identity.server.files, settings.cluster_id, lambda: identity.revoked)
        if identity.server is not None
        else None
    )
    if tls is None:
        log.warning("the rank store listens without TLS (plaintext development flag): anyone may join it")
    ranks = ClusterRanks(settings.ranks_listen, settings.ranks, tls=tls)
    stack.callback(ranks.close)
    return ranks


def _check_edge_tls(settings: TrainerSettings, identity: ServiceIdentity) -> None:
    """A TCP switch edge socket is mutual TLS with this trainer's identity: refuse to start without one."""
    edge = settings.switch_edge_socket
    if edge and edge_address(edge, EDGE_SETTING)[0] == TLS and identity.client is None:
        raise InternalTlsError(
            f"{EDGE_SETTING}={edge!r} is a TCP port, which needs internal TLS (mutual TLS 1.3 with this "
            "trainer's certificate); give the switch's socket path instead, or internal TLS files"
        )


async def start_trainer(
    settings: TrainerSettings, stack: contextlib.AsyncExitStack
) -> Started[TrainerServicer]:
    """Token keys and the audit log, then the server; stages are stopped before the log is sealed."""
    torch.set_num_threads(settings.torch_threads)
    identity = await service_identity(stack, settings, "trainer")
    _check_edge_tls(settings, identity)
    verifier = await token_verifier(stack, settings.auth_address, settings.cluster_id, tls=identity.client)
    data_dir = settings.resolved_data_dir()
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Submits and stage starts/stops are rare: fsync each record so none is lost in a crash.
    audit = await service_audit(
        stack, data_dir, service="trainer", cluster=settings.cluster_id, signer=settings.audit_signer
    )
    confinement = await asyncio.to_thread(
        choose_confinement, settings.stage_isolation, data_dir / "sandbox-probe", settings.stage_cgroup
    )
    ranks_accounts = RankAccounts.parse(settings.ranks_accounts)
    if settings.ranks_listen is not None:
        fields = {"ranks_listen": settings.ranks_listen, "ranks_for": ranks_accounts.describe()}
        if landlock.abi() < landlock.TCP_ABI:  # a driver's box keeps the host's network, every port of it
            log.warning(
                "stages on cluster ranks are driven from their stage box, which reaches every TCP port of "
                "this host: the kernel's Landlock has no TCP rule (ABI 4, Linux 6.7)",
                extra={"fields": fields},
            )
        else:
            log.info(
                "stages on cluster ranks are driven from their stage box (TCP to ephemeral ports only), "
                "each worker boxes its part",
                extra={"fields": fields},
            )
    if confinement.weaker_because:
        log.warning(
            "stages run under Landlock, without namespaces"
            if confinement.mode == "landlock"
            else "stages run without namespaces: a job's code can read what the trainer's user can",
            extra={"fields": {"isolation": confinement.describe(), "reason": confinement.weaker_because}},
        )
    else:
        log.info("stages run confined", extra={"fields": {"isolation": confinement.describe()}})
    job_tokens = JobTokens(settings.auth_address, identity.client, switch_address=settings.switch_address)
    stack.push_async_callback(job_tokens.close)
    servicer = TrainerServicer(
        settings.cluster_id,
        settings.switch_address,
        data_dir,
        audit,
        data_service_address=settings.data_service_address,
        edge_settings=EdgeSettings(
            window_bytes=settings.edge_window_bytes,
            max_outage_s=settings.edge_max_outage_s,
        ),
        finished=FinishedStages(settings.finished_ttl_s, settings.max_finished),
        receive_ahead=settings.receive_ahead,
        confinement=confinement,
        limits=StageLimits(
            memory_bytes=settings.stage_memory_mb << 20,
            cpu_seconds=settings.stage_cpu_seconds,
            open_files=settings.stage_open_files,
            processes=settings.stage_max_processes,
        ),
        torch_threads=settings.torch_threads,
        log_level=settings.log_level,
        job_tokens=job_tokens,
        cluster_ranks=_cluster_ranks(settings, identity, stack),
        ranks_accounts=ranks_accounts,
        switch_edge_socket=settings.switch_edge_socket,
    )
    stack.callback(servicer.close)  # after the stages stopped (below): their ends are audited
    stack.push_async_callback(asyncio.to_thread, _stop_stages, servicer, settings.stop_grace_s)
    # Before serving: a client re-watching its stage after this restart finds it (RECOVERING or ended).
    restored = await restore_stages(servicer, verifier)
    renewals = asyncio.create_task(servicer.renew_job_tokens(), name="job-token-renewal")
    stack.push_async_callback(_cancelled, renewals)
    if any(restored.values()):
        log.info("stages restored from their records", extra={"fields": restored})
    server = grpc_server(
        stack,
        ["nebula.v1.Trainer", AUDIT_SERVICE_NAME],
        grace=STOP_GRACE_SECONDS,
        interceptors=[*identity.interceptors(audit), TokenAuthInterceptor("trainer", verifier, audit=audit)],
        options=internal_server_options(),
    )
    # Again, to run first on a stop: stages are drained at once, not after the server's grace for
    # its open calls (watch streams stay open until they end); the earlier one covers a failed start.
    stack.push_async_callback(asyncio.to_thread, _stop_stages, servicer, settings.stop_grace_s)
    trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, server.server)
    add_audit_api(server, audit, "trainer", settings.cluster_id)
    announced: dict[str, int | str | None] = {
        **await start_internal(server, identity, settings, settings.listen)
    }
    announced["stage_isolation"] = confinement.describe()
    if settings.ranks_listen is not None:
        announced["stage_isolation"] += (
            f"; on the cluster's ranks (driven from the stage's box, each rank's part boxed by its worker): "
            f"{ranks_accounts.describe()}"
        )
    announced["stage_edges"] = describe_edges(settings.switch_edge_socket)
    return Started(servicer, announced)


def describe_edges(edge_socket: str) -> str:
    """How this trainer's stages carry their edges (``nebula local status`` names it, never silently)."""
    if not edge_socket:
        return "gRPC through each stage's proxy (no switch edge socket named)"
    if edge_address(edge_socket, EDGE_SETTING)[0] == TLS:
        return f"sealed records on the switch's edge port {edge_socket} (mutual TLS 1.3)"
    return f"records on the switch's edge socket {edge_socket}"


SERVICE = ServiceDefinition("trainer", TrainerSettings, start_trainer)
