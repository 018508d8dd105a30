"""IssueJobToken: the short-lived, job-scoped credential a running job acts with.

A stage acts for its owner on the switch (its edges) and the data service (its batches). Holding the
owner's own token for that would make every running job, and every file the trainer keeps about it,
worth the whole account for a token lifetime. A job token is worth one job: role ``job`` and a
``job`` claim, accepted only by ``policy.JOB_METHODS`` (the switch also checks that an edge names the
token's job), living ``job_token_ttl_seconds``. The trainer trades the submitter's token for one when a
stage is assigned and renews it with itself at half-life while the job runs, so a job outlives any
account token; disabling the account or changing its password revokes its job tokens with the rest.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

from nebula_common.auth.interceptor import caller as current_caller
from nebula_common.proto.nebula.v1 import auth_pb2

if TYPE_CHECKING:
    from services.auth.tokens import TokenIssuer

JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""What a job id may be (the trainer's own rule for ``StageSpec.job_id``)."""


class JobTokenRpc:
    """The IssueJobToken method of ``AuthServicer`` (its issuer and audit log are the servicer's)."""

    # Both provided by ``AuthServicer``, which this class is mixed into.
    _issuer: TokenIssuer
    _record: Callable[..., Awaitable[None]]

    async def IssueJobToken(
        self, request: auth_pb2.IssueJobTokenRequest, context: grpc.aio.ServicerContext
    ) -> auth_pb2.JobToken:
        principal = current_caller().principal  # account re-read by the interceptor's account check
        job_id = request.job_id
        if not JOB_ID.fullmatch(job_id):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "job_id must be 1-128 characters of [A-Za-z0-9._-], the first a letter or digit",
            )
        renewal = bool(principal.job_id)
        if renewal and principal.job_id != job_id:
            details: dict[str, Any] = {"job_id": job_id, "token_job": principal.job_id}
            await self._record(
                "token.job_issue", outcome="refused", account=principal.username, details=details
            )
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"a job token of job {principal.job_id} cannot be traded for one of job {job_id}",
            )
        issued = await asyncio.to_thread(self._issuer.issue_job, principal.username, job_id)
        await self._record(
            "token.job_issue",
            account=principal.username,
            details={"job_id": job_id, "renewal": renewal, "expires_at": issued.expires_at},
        )
        return auth_pb2.JobToken(token=issued.token, expires_at=issued.expires_at)
