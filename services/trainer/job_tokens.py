"""Job tokens: what a running stage acts with instead of its owner's own token.

When a stage is assigned, the trainer trades the submitter's token for a job token at the auth
service (``auth.proto`` IssueJobToken; the trainer's certificate is the only one allowed to ask),
and keeps only that: in the stage's record on disk and in the runner, which hands it to the switch
for the stage's edges and to the data service for its batches. A job token is valid for that job
alone and lives minutes, so the trainer renews every running stage's token once half its life has
passed (with the token itself), and a stage outlives any account token. A stage restored after a
restart gets a fresh one at once. Each renewed token is then presented to the switch
(``Relay/RenewEdges``), which ends a live edge once the token it runs on has expired everywhere; a
presentation that fails is retried at the next check. A renewal the auth service refuses (the account
was disabled, its password changed) is logged; the stage keeps the token it has until that expires,
then its next call is refused and its edges end like any revoked caller's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import grpc
import jwt

from nebula_common.errors import NebulaError
from nebula_common.proto.nebula.v1 import auth_pb2, auth_pb2_grpc, relay_pb2, relay_pb2_grpc
from nebula_common.rpc import bearer_metadata
from nebula_common.rpc.internal_tls import ClientTls, internal_channel

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0
"""Deadline of one IssueJobToken call (a submit waits on it)."""

CHECK_INTERVAL_S = 5.0
"""How often running stages' tokens are looked at; renewals happen at half-life, so minutes apart."""


class JobTokenError(NebulaError):
    """The auth service did not give a job token (unreachable, or it refused the caller)."""


@dataclass(frozen=True)
class TokenTimes:
    """When a token was issued and when it expires (seconds since the epoch, from its claims)."""

    issued_at: float
    expires_at: float

    @classmethod
    def of(cls, token: str) -> TokenTimes:
        """Read ``iat``/``exp`` without verifying: only to plan the renewal of a token we were given."""
        claims = jwt.decode(token, options={"verify_signature": False})
        issued, expires = claims.get("iat"), claims.get("exp")
        if not isinstance(issued, int | float) or not isinstance(expires, int | float):
            raise ValueError("token has no iat/exp")
        return cls(float(issued), float(expires))

    def due(self, now: float) -> bool:
        """True once half the token's life has passed."""
        return now >= self.issued_at + (self.expires_at - self.issued_at) / 2


class HoldsToken(Protocol):
    """A stage runner: the servicer's ``Stage`` (its ``token`` is what its calls present)."""

    token: str


class JobTokens:
    """The trainer's client of ``Auth/IssueJobToken``: issue at submit, renew while jobs run."""

    def __init__(self, auth_address: str, tls: ClientTls | None = None, switch_address: str = "") -> None:
        self._address = auth_address
        self._tls = tls
        self._channel = internal_channel(auth_address, service="auth", tls=tls, aio=True)
        self._stub = auth_pb2_grpc.AuthStub(self._channel)
        self._switch = (
            internal_channel(switch_address, service="switch", tls=tls, aio=True) if switch_address else None
        )
        self._presented: dict[str, str] = {}
        """job id -> the token the switch last took for that job's edges."""

    async def issue(self, bearer: str, job_id: str) -> str:
        """A job token for ``job_id``, asked with ``bearer`` (the submitter's token, or the job's own)."""
        try:
            reply = await self._stub.IssueJobToken(
                auth_pb2.IssueJobTokenRequest(job_id=job_id),
                metadata=bearer_metadata(bearer),
                timeout=CALL_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                # A new channel presents the certificate on disk now (a renewal may have replaced it).
                old, self._channel = (
                    self._channel,
                    internal_channel(self._address, service="auth", tls=self._tls, aio=True),
                )
                self._stub = auth_pb2_grpc.AuthStub(self._channel)
                await old.close()
            raise JobTokenError(
                f"the auth service at {self._address} gave no job token: {exc.code().name}: {exc.details()}"
            ) from exc
        return str(reply.token)

    async def renew_due(
        self, stages: Iterable[tuple[str, HoldsToken, Callable[[str], None]]], now: float | None = None
    ) -> int:
        """Renew each ``(job_id, runner, store)`` whose token is past half-life; returns how many.

        ``store`` persists the new token (the stage's record) before the runner starts using it, so
        a restart never finds an older token on disk than the one in use.
        """
        moment = time.time() if now is None else now
        stages = list(stages)
        renewed = 0
        for job_id, runner, store in stages:
            current = runner.token
            self._presented.setdefault(job_id, current)  # what its edges opened with, at the latest
            try:
                if not current or not TokenTimes.of(current).due(moment):
                    continue
            except (ValueError, jwt.PyJWTError):
                log.error("stage token unreadable; not renewed", extra={"fields": {"job_id": job_id}})
                continue
            try:
                fresh = await self.issue(current, job_id)
            except JobTokenError as exc:
                log.warning("job token not renewed: %s", exc, extra={"fields": {"job_id": job_id}})
                continue
            await asyncio.to_thread(store, fresh)
            runner.token = fresh
            renewed += 1
        if self._switch is not None:
            await self._present(stages)
        return renewed

    async def _present(self, stages: Iterable[tuple[str, HoldsToken, Callable[[str], None]]]) -> None:
        """Give the switch each stage's token it has not taken yet, so the job's live edges run on.

        The token a stage held when first seen needs no presenting (its edges opened with it).
        """
        assert self._switch is not None
        stub = relay_pb2_grpc.RelayStub(self._switch)
        running = {job_id: runner.token for job_id, runner, _ in stages if runner.token}
        presented = {job: token for job, token in self._presented.items() if job in running}
        for job_id, token in running.items():
            if presented.get(job_id) == token:
                continue
            try:
                await stub.RenewEdges(
                    relay_pb2.RenewEdgesRequest(job_id=job_id),
                    metadata=bearer_metadata(token),
                    timeout=CALL_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "the switch did not take the renewed job token: %s: %s (retried in %.0f s)",
                    exc.code().name,
                    exc.details(),
                    CHECK_INTERVAL_S,
                    extra={"fields": {"job_id": job_id}},
                )
                continue
            presented[job_id] = token
        self._presented = presented

    async def close(self) -> None:
        await self._channel.close()
        if self._switch is not None:
            await self._switch.close()


__all__ = ["CHECK_INTERVAL_S", "JobTokenError", "JobTokens", "TokenTimes"]
