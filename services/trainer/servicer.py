"""Trainer control servicer: thin mapping from RPCs to StageRunner and domain errors to status codes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from nebula_common.auth import Principal, TokenVerifier
from nebula_common.errors import AuthenticationError, InvalidRequestError
from nebula_common.proto.nebula.v1 import trainer_pb2, trainer_pb2_grpc
from nebula_common.rpc import bearer_token_from_metadata
from services.trainer.metrics import STAGES_RUNNING
from services.trainer.runner import StageRunner
from services.trainer.status import TERMINAL_STATES
from services.trainer.validation import validate_stage_spec

log = logging.getLogger(__name__)


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, cluster_id: str, verifier: TokenVerifier, switch_address: str) -> None:
        self.cluster_id = cluster_id
        self.verifier = verifier
        self.switch_address = switch_address
        self.runners: dict[str, StageRunner] = {}
        self.owners: dict[str, str] = {}

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> tuple[Principal, str]:
        token = bearer_token_from_metadata(context.invocation_metadata())
        if token is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing bearer token")
        try:
            return self.verifier.verify(token), token
        except AuthenticationError as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"invalid token: {exc}")
        raise AssertionError("unreachable: abort raises")

    async def _owned_runner(self, job_id: str, context: grpc.aio.ServicerContext) -> StageRunner:
        principal, _ = await self._authenticate(context)
        runner = self.runners.get(job_id)
        # Another account's job is reported as absent, not forbidden: its existence is not ours to reveal.
        if runner is None or (self.owners[job_id] != principal.username and principal.role != "admin"):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job {job_id!r} on this trainer")
        return runner

    async def AssignStage(
        self, request: trainer_pb2.AssignStageRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.AssignStageResponse:
        principal, token = await self._authenticate(context)
        spec = request.spec
        try:
            validate_stage_spec(spec)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if spec.job_id in self.runners:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"job {spec.job_id!r} already exists here")
        runner = StageRunner(spec, token, self.switch_address)
        self.runners[spec.job_id] = runner
        self.owners[spec.job_id] = principal.username
        runner.start()
        STAGES_RUNNING.inc()
        asyncio.get_running_loop().run_in_executor(None, self._track_finish, runner)
        log.info(
            "stage assigned",
            extra={"fields": {"job_id": spec.job_id, "stage": spec.stage, "account": principal.username}},
        )
        return trainer_pb2.AssignStageResponse(job_id=spec.job_id, authorised_by=principal.username)

    @staticmethod
    def _track_finish(runner: StageRunner) -> None:
        runner.join()
        STAGES_RUNNING.dec()

    async def WatchStage(
        self, request: trainer_pb2.WatchStageRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[trainer_pb2.StageStatus]:
        runner = await self._owned_runner(request.job_id, context)
        version = 0
        while True:
            version, updates = await asyncio.to_thread(runner.board.since, version, 1.0)
            for status in updates:
                yield status
                if status.state in TERMINAL_STATES:
                    return

    async def CancelStage(
        self, request: trainer_pb2.CancelStageRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.CancelStageResponse:
        runner = await self._owned_runner(request.job_id, context)
        runner.cancel()
        return trainer_pb2.CancelStageResponse()
