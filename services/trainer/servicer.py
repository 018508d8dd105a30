"""Trainer control servicer: thin mapping from RPCs to stage runners and domain errors to status codes.

Every decision about a job is audited here (submit, start, stop, cancel, and every refusal), in
the trainer's own hash-chained log: the cluster that owns the hardware keeps the record of what
ran on it and on whose authority.

No thread is held per stage or per watcher: a stage's end is a callback from its own thread
(``StageLifecycle.add_finish_callback``) and ``WatchStage`` awaits the status board on the loop.
Audit appends (an fsync each) go to one dedicated thread, never to asyncio's small default
executor, so they cannot queue behind anything else.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from nebula_common.audit import AuditLog
from nebula_common.auth import Principal
from nebula_common.auth.interceptor import caller
from nebula_common.errors import InvalidRequestError
from nebula_common.proto.nebula.v1 import trainer_pb2, trainer_pb2_grpc
from services.trainer.edge import EdgeSettings
from services.trainer.history import StepHistory, history_path, read_history
from services.trainer.job_tokens import CHECK_INTERVAL_S, JobTokenError, JobTokens
from services.trainer.memory import return_freed_memory
from services.trainer.metrics import REAPER, STAGES_FINISHED, STAGES_RUNNING, record_codecs
from services.trainer.placement import Placement
from services.trainer.rank_accounts import RankAccounts
from services.trainer.records import StageRecord, StageRecords
from services.trainer.retention import FinishedStages
from services.trainer.runtime.checkpoint import CheckpointError, CheckpointStore
from services.trainer.runtime.rank_sources import ClusterRanks
from services.trainer.runtime.stage import ProgramRunner
from services.trainer.sandbox import Confinement, StageLimits
from services.trainer.stage_process import StageProcess
from services.trainer.status import TERMINAL_STATES
from services.trainer.validation import validate_stage_spec

log = logging.getLogger(__name__)
METRICS_GRACE_S = 60.0
"""How long a finished stage's per-job series (labels job_id, stage) stay on /metrics, so that the last
scrape sees its final values."""
Stage = ProgramRunner | StageProcess
"""A stage as the servicer keeps it: in a confined process of its own, or (no confinement) on a thread."""


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(
        self,
        cluster_id: str,
        switch_address: str,
        data_dir: Path,
        audit: AuditLog,
        data_service_address: str | None = None,
        edge_settings: EdgeSettings | None = None,
        finished: FinishedStages | None = None,
        metrics_grace_s: float = METRICS_GRACE_S,
        receive_ahead: int | None = None,
        cluster_ranks: ClusterRanks | None = None,
        ranks_accounts: RankAccounts | None = None,
        confinement: Confinement | None = None,
        limits: StageLimits | None = None,
        torch_threads: int = 1,
        log_level: str = "INFO",
        job_tokens: JobTokens | None = None,
        switch_edge_socket: str = "",
    ) -> None:
        self.switch_edge_socket = switch_edge_socket
        """The switch's edge socket: stage processes carry their edges there as records (empty: gRPC)."""
        self.job_tokens = job_tokens
        """Where stages get job tokens (``job_tokens``); None: a stage acts with its submitter's token."""
        self.limits = limits or StageLimits(memory_bytes=8 << 30, cpu_seconds=30 * 24 * 3600, open_files=4096)
        self.torch_threads = torch_threads
        self.log_level = log_level
        self.receive_ahead = receive_ahead
        self.where = Placement(confinement, cluster_ranks, ranks_accounts or RankAccounts())
        """Where each stage runs and how it is confined (``placement``; no confinement: on threads of this
        process, as tests run them)."""
        self.finished = finished or FinishedStages()
        self.metrics_grace_s = metrics_grace_s
        self.edge_settings = edge_settings or EdgeSettings()
        self.cluster_id = cluster_id
        self.switch_address = switch_address
        self.checkpoints = CheckpointStore(data_dir)
        self.audit = audit
        self.data_service_address = data_service_address
        self.records = StageRecords(data_dir, audit)
        self.runners: dict[str, Stage] = {}
        self.owners: dict[str, str] = {}
        # Each known stage's record (digest, steps, start and end): what ListStages shows beside its status.
        self.stage_records: dict[str, StageRecord] = {}
        self._audit_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-audit")

    def close(self) -> None:
        """Release the audit thread once every stage has stopped (its worker would hold the exit)."""
        self._audit_thread.shutdown(wait=True)

    async def _record(self, event: str, **fields: object) -> None:
        append = functools.partial(self.audit.append, event, **fields)  # type: ignore[arg-type]
        await asyncio.get_running_loop().run_in_executor(self._audit_thread, append)

    @staticmethod
    def _authenticate() -> tuple[Principal, str]:
        """The caller the token interceptor verified, and their token (stages act on their behalf)."""
        current = caller()
        return current.principal, current.token

    async def _owned_runner(
        self, job_id: str, context: grpc.aio.ServicerContext, action: str
    ) -> tuple[Principal, Stage]:
        principal, _ = self._authenticate()
        runner = self.runners.get(job_id)
        # Another account's job is reported as absent, not forbidden: its existence is not ours to reveal.
        if runner is None or (self.owners.get(job_id) != principal.username and principal.role != "admin"):
            await self._record(
                action,
                outcome="refused",
                account=principal.username,
                job_id=job_id,
                details={"reason": "not found"},
            )
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job {job_id!r} on this trainer")
        return principal, runner

    async def _refuse(
        self,
        context: grpc.aio.ServicerContext,
        code: grpc.StatusCode,
        message: str,
        account: str,
        job_id: str,
        reason: str = "",
        submitted: dict[str, object] | None = None,
    ) -> None:
        """Audit a refused submission (with the reason, ``message`` unless given), then abort the call."""
        details = {**(submitted or {}), "reason": reason or message}
        await self._record("job.submit", outcome="refused", account=account, job_id=job_id, details=details)
        await context.abort(code, message)

    async def AssignStage(
        self, request: trainer_pb2.AssignStageRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.AssignStageResponse:
        principal, token = self._authenticate()
        spec = request.spec
        account, job_id = principal.username, spec.job_id
        submitted = {
            "stage": spec.stage,
            "codec_forward": spec.codec_forward,
            "codec_backward": spec.codec_backward,
            "codec_choice": spec.codec_choice,
            "dataset": spec.program.dataset,
        }
        if spec.program.initial_state:
            state = spec.program.initial_state
            # A digest, never the weights: the record proves which state started the stage.
            submitted["hot_start"] = {
                "step": spec.program.initial_step,
                "bytes": len(state),
                "sha256": hashlib.sha256(state).hexdigest(),
            }
        # The one place a StageSpec is accepted: every check (and any future policy) runs here,
        # before a runner exists.
        try:
            # In a thread: a pre-trained directory's check reads files and may import transformers.
            await asyncio.to_thread(validate_stage_spec, spec)
            self.where.check_allows(spec, account)
        except InvalidRequestError as exc:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc), account, job_id)
        self._forget(self.finished.expire())
        if job_id in self.runners:
            # Same answer whoever holds the id: job ids are global here, like account names, and the
            # reply must not tell another account anything about the job that has it.
            message = f"job id {job_id!r} is not available on this trainer"
            await self._refuse(context, grpc.StatusCode.ALREADY_EXISTS, message, account, job_id, "id taken")
        resume = spec.program.resume_job_id
        if resume:
            held = self.checkpoints.steps(account, resume, spec.stage)
            submitted["resume"] = {"job_id": resume, "step": spec.program.resume_step}
            if spec.program.resume_step not in held:
                message = (
                    f"no checkpoint of job {resume!r} stage {spec.stage!r} at step "
                    f"{spec.program.resume_step} for this account on cluster {self.cluster_id}"
                )
                reason = "no such checkpoint for this account"
                code = grpc.StatusCode.FAILED_PRECONDITION
                await self._refuse(context, code, message, account, job_id, reason, submitted)
        if self.job_tokens is not None:
            try:
                token = await self.job_tokens.issue(token, job_id)
            except JobTokenError as exc:
                code = grpc.StatusCode.UNAVAILABLE
                await self._refuse(context, code, str(exc), account, job_id, str(exc), submitted)
        await self._record("job.submit", account=account, job_id=job_id, details=submitted)
        runner = self._make_runner(spec, token, principal.username)
        self.runners[spec.job_id] = runner
        self.owners[spec.job_id] = principal.username
        codecs = {"codec_forward": spec.codec_forward, "codec_backward": spec.codec_backward}
        runner.board.update(**codecs, codec_choice=spec.codec_choice)
        # Recorded before the thread starts, so a stage that ends at once cannot log its stop first.
        started = {"stage": spec.stage, "placement": self.where.describe(spec, account)}
        await self._record("stage.start", account=account, job_id=job_id, details=started)
        self._launch(runner, account)
        log.info("stage assigned", extra={"fields": {"job_id": job_id, "account": account, **started}})
        return trainer_pb2.AssignStageResponse(
            job_id=job_id, authorised_by=account, placement=started["placement"]
        )

    def _make_runner(
        self, spec: trainer_pb2.StageSpec, token: str, owner: str, record: StageRecord | None = None
    ) -> Stage:
        """The runner of a stage, remembered on disk first so that a restarted trainer can resume it.

        A new stage gets a record at epoch 0; a restored one (``record``, see ``restore.py``) runs at
        the epoch after its record's. The record follows the stage: each epoch before it is opened,
        and its final status once it ends.
        """
        epoch = 0 if record is None else record.epoch + 1
        record = record or self.records.create(spec, token, owner)
        self.stage_records[spec.job_id] = record
        runner: Stage
        on_ranks = self.where.on_cluster_ranks(spec, owner)
        if not self.where.boxed(spec, owner):
            runner = ProgramRunner(
                spec,
                token,
                self.switch_address,
                self.checkpoints.root,
                owner,
                self.data_service_address,
                edge_settings=self.edge_settings,
                epoch=epoch,
                on_epoch=lambda epoch: self.records.set_epoch(record, epoch),
                receive_ahead=self.receive_ahead,
                cluster_ranks=self.where.cluster_ranks if on_ranks else None,
            )
        else:
            runner = StageProcess(
                spec,
                token,
                self.switch_address,
                self.checkpoints.root,
                owner,
                self.data_service_address,
                confinement=self.where.confinement,
                limits=self.limits,
                edge_settings=self.edge_settings,
                epoch=epoch,
                on_epoch=lambda epoch: self.records.set_epoch(record, epoch),
                receive_ahead=self.receive_ahead,
                torch_threads=self.torch_threads,
                log_level=self.log_level,
                on_refusal=functools.partial(self._stage_refused, owner, spec.job_id),
                switch_edge_socket=self.switch_edge_socket,
                cluster_ranks=self.where.cluster_ranks if on_ranks else None,
            )
        # Every step goes to the stage's history file (``history``); a restored stage's watchers see
        # the steps before the restart first.
        history = StepHistory(history_path(record.path))
        if epoch > 0:
            earlier = read_history(history.path, spec.job_id, spec.stage)
            for status in earlier:
                runner.board.publish(status)
            history.follows(earlier[-1] if earlier else None)
        runner.board.subscribe(history.record)
        # First of the finish callbacks (``_launch`` adds the release after it): the end is on disk
        # before the stage is released or forgotten.
        runner.lifecycle.add_finish_callback(functools.partial(self.records.store_end, record, runner.board))
        runner.lifecycle.add_finish_callback(history.close)
        return runner

    async def renew_job_tokens(self, interval_s: float = CHECK_INTERVAL_S) -> None:
        """Keep every running stage's job token fresh until cancelled (a task of the trainer)."""
        assert self.job_tokens is not None
        while True:
            await asyncio.sleep(interval_s)
            running = [
                (job_id, runner, functools.partial(self.records.set_token, self.stage_records[job_id]))
                for job_id, runner in list(self.runners.items())
                if isinstance(runner, ProgramRunner | StageProcess)
                and job_id in self.stage_records
                and not self.stage_records[job_id].terminal
            ]
            await self.job_tokens.renew_due(running)

    async def ListCheckpoints(
        self, request: trainer_pb2.ListCheckpointsRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.ListCheckpointsResponse:
        principal, _ = self._authenticate()
        # Only the caller's own namespace is ever looked at: another account's checkpoints do not exist here.
        try:
            steps = self.checkpoints.steps(principal.username, request.job_id, request.stage)
        except CheckpointError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not steps:
            await self._record(
                "checkpoint.list", outcome="refused", account=principal.username, job_id=request.job_id
            )
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no checkpoints of job {request.job_id!r} here")
        return trainer_pb2.ListCheckpointsResponse(steps=steps)

    async def ListStages(
        self, request: trainer_pb2.ListStagesRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.ListStagesResponse:
        principal, _ = self._authenticate()
        admin = principal.role == "admin"
        infos = []
        for job_id, runner in list(self.runners.items()):
            owner = self.owners.get(job_id, "")
            # Another account's stage is not listed at all: its existence is not ours to reveal.
            if (request.job_id and job_id != request.job_id) or (owner != principal.username and not admin):
                continue
            latest = runner.board.latest()
            record = self.stage_records.get(job_id)
            if record is None:  # not reachable through AssignStage or a restore; shown with what is known
                infos.append(trainer_pb2.StageRecordInfo(status=latest, owner=owner))
            else:
                infos.append(record.info(latest))
        infos.sort(key=lambda info: (info.started_unix, info.status.job_id))
        return trainer_pb2.ListStagesResponse(stages=infos)

    def _stage_refused(self, account: str, job_id: str, reason: str) -> None:
        """A stage process asked its proxy for something that is not its own (on a proxy thread)."""
        self.audit.append(
            "stage.refused", outcome="refused", account=account, job_id=job_id, details={"reason": reason}
        )

    def _launch(self, runner: Stage, account: str) -> None:
        """Start ``runner``'s thread; its end (``_stage_finished``) is a callback from that thread."""
        runner.lifecycle.add_finish_callback(functools.partial(self._stage_finished, runner, account))
        spec = runner.spec
        record_codecs(spec.job_id, spec.stage, spec.codec_forward, spec.codec_backward, spec.codec_choice)
        STAGES_RUNNING.inc()
        runner.start()

    def _stage_finished(self, runner: Stage, account: str) -> None:
        """On the stage's own thread, after its terminal status: release it, count it, audit its end."""
        runner.release()  # the status board stays; the model, optimizer and edge buffers go
        # The program's source and a hot start's weights are only needed to start it.
        runner.spec.program.ClearField("module_source")
        runner.spec.program.ClearField("initial_state")
        return_freed_memory()
        STAGES_RUNNING.dec()
        final = runner.board.latest()
        STAGES_FINISHED.labels(
            trainer_pb2.StageState.Name(final.state).removeprefix("STAGE_STATE_").lower()
        ).inc()
        REAPER.forget_after(final.job_id, final.stage, self.metrics_grace_s)
        self._forget(self.finished.add(final.job_id))
        self.audit.append(
            "stage.stop",
            outcome="ok" if final.state == trainer_pb2.STAGE_STATE_SUCCEEDED else "failure",
            account=account,
            job_id=final.job_id,
            details={
                "stage": final.stage,
                "state": trainer_pb2.StageState.Name(final.state),
                "steps_done": final.steps_done,
                "message": final.message,
            },
        )

    def _forget(self, job_ids: list[str]) -> None:
        """Drop finished stages past their time or count: their final status is no longer served, and
        their records go, so neither memory nor the data dir grows with every job."""
        for job_id in job_ids:
            self.runners.pop(job_id, None)
            self.stage_records.pop(job_id, None)
            owner = self.owners.pop(job_id, None)
            if owner is not None:  # its record goes too: a restart does not bring it back
                self.records.remove(owner, job_id)

    async def WatchStage(
        self, request: trainer_pb2.WatchStageRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[trainer_pb2.StageStatus]:
        _, runner = await self._owned_runner(request.job_id, context, "job.watch")
        version = 0
        while True:
            version, updates = await runner.board.wait_since(version)
            for status in updates:
                yield status
                if status.state in TERMINAL_STATES:
                    return

    async def CancelStage(
        self, request: trainer_pb2.CancelStageRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.CancelStageResponse:
        principal, runner = await self._owned_runner(request.job_id, context, "job.cancel")
        runner.cancel()
        await self._record("job.cancel", account=principal.username, job_id=request.job_id)
        return trainer_pb2.CancelStageResponse()
