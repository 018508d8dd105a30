"""At trainer start: the stages this trainer ran before it was restarted, back from their records.

Every stage that had not ended restarts by itself at the next epoch (``record.epoch + 1``): its
runner negotiates with the other cluster's stage, over the edge, the last checkpoint both hold and
continues from there, exactly-once (see "Epochs" in ``proto/nebula/v1/relay.proto``). Each such
restore is audited (``stage.recover``) and its status is RECOVERING, with a message saying why,
until it runs again. A stage that had ended comes back as its final status only, so a client that
watches it after any restart still learns how it ended.

A restored stage acts with its record's job token (``job_tokens``; the switch checks it when the
stage reopens its edge, the data service on every batch), renewed here before it runs. The running
trainer renewed it at half-life, so it still verifies after any restart shorter than half a job
token's life (``job_token_ttl_seconds``, 15 min by default) whatever the job's age. A token that no
longer verifies (expired, or revoked with its account) cannot be renewed, so that stage fails at once
with a reason naming it, instead of failing later at the switch with a message that does not say why.

Runs before the trainer serves: a client that re-watches after the restart finds its stage.
"""

from __future__ import annotations

import asyncio
import datetime
import logging

import jwt

from nebula_common.auth import TokenVerifier
from nebula_common.errors import AuthenticationError
from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer.history import history_path, read_history
from services.trainer.job_tokens import JobTokenError
from services.trainer.records import FinishedStage, StageRecord
from services.trainer.servicer import TrainerServicer

log = logging.getLogger(__name__)


def token_problem(verifier: TokenVerifier, record: StageRecord) -> str | None:
    """Why the record's token can no longer act for its owner (None: it still can)."""
    try:
        principal = verifier.verify(record.token)
    except AuthenticationError as exc:
        reason = str(exc)
        if reason == "token expired":
            expiry = jwt.decode(record.token, options={"verify_signature": False}).get("exp")
            if isinstance(expiry, int | float):
                at = datetime.datetime.fromtimestamp(expiry, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
                reason = f"token expired at {at}"
        return reason
    if principal.username != record.owner:
        return f"token is {principal.username!r}'s, the stage is {record.owner!r}'s"
    if principal.job_id and principal.job_id != record.job_id:
        return f"token is for job {principal.job_id!r}, the stage is of job {record.job_id!r}"
    return None


async def restore_stages(servicer: TrainerServicer, verifier: TokenVerifier) -> dict[str, int]:
    """Put every recorded stage back into ``servicer`` (see the module doc); counts by outcome."""
    counts = {"resumed": 0, "ended": 0, "failed": 0}
    records = await asyncio.to_thread(servicer.records.load_all)
    for record in records:
        if record.job_id in servicer.runners:  # two owners' records of one id: only by hand-made files
            log.error("stage record %s skipped: job id %r is already restored", record.path, record.job_id)
            continue
        if record.terminal:
            history = history_path(record.path)
            steps = await asyncio.to_thread(read_history, history, record.job_id, record.stage)
            servicer.runners[record.job_id] = FinishedStage(record.final, record.owner, steps)  # type: ignore[assignment, arg-type]
            servicer.owners[record.job_id] = record.owner
            servicer.stage_records[record.job_id] = record
            # Ended before the restart, still bounded like any ended stage (time and count).
            servicer._forget(servicer.finished.add(record.job_id))
            counts["ended"] += 1
            continue
        problem = token_problem(verifier, record)
        if problem is not None:
            await _fail(servicer, record, f"cannot resume after the trainer restarted: the owner's {problem}")
            counts["failed"] += 1
            continue
        await _fresh_token(servicer, record)
        try:
            runner = servicer._make_runner(record.spec, record.token, record.owner, record)
        except Exception as exc:  # one stage that cannot be rebuilt must not keep the trainer down
            log.exception("stage not restored", extra={"fields": {"job_id": record.job_id}})
            await _fail(
                servicer, record, f"cannot resume after the trainer restarted: {type(exc).__name__}: {exc}"
            )
            counts["failed"] += 1
            continue
        servicer.runners[record.job_id] = runner
        servicer.owners[record.job_id] = record.owner
        spec = record.spec
        # The runner posts RECOVERING (and why) first thing on its thread; the codecs go on before it.
        runner.board.update(
            codec_forward=spec.codec_forward,
            codec_backward=spec.codec_backward,
            codec_choice=spec.codec_choice,
        )
        await servicer._record(
            "stage.recover",
            account=record.owner,
            job_id=record.job_id,
            details={"stage": record.stage, "epoch": record.epoch + 1, "previous_epoch": record.epoch},
        )
        servicer._launch(runner, record.owner)
        counts["resumed"] += 1
        log.info(
            "stage restored",
            extra={"fields": {"job_id": record.job_id, "stage": record.stage, "epoch": record.epoch + 1}},
        )
    return counts


async def _fresh_token(servicer: TrainerServicer, record: StageRecord) -> None:
    """A new job token for a restored stage (a record of an older trainer may hold its owner's token)."""
    if servicer.job_tokens is None:
        return
    try:
        fresh = await servicer.job_tokens.issue(record.token, record.job_id)
    except JobTokenError as exc:  # the token it has is still valid: the renewal task tries again
        log.warning("restored stage keeps its token: %s", exc, extra={"fields": {"job_id": record.job_id}})
        return
    await asyncio.to_thread(servicer.records.set_token, record, fresh)


async def _fail(servicer: TrainerServicer, record: StageRecord, message: str) -> None:
    """A stage that cannot resume: its record ends FAILED with ``message``, which watchers see."""
    final = trainer_pb2.StageStatus(
        job_id=record.job_id,
        stage=record.stage,
        state=trainer_pb2.STAGE_STATE_FAILED,
        message=message,
        epoch=record.epoch,
    )
    try:
        await asyncio.to_thread(servicer.records.finish, record, final)
    except OSError as exc:  # watchers still see the failure; only the next restart would not
        log.error("cannot store the end of stage %s: %s", record.job_id, exc)
    servicer.runners[record.job_id] = FinishedStage(final, record.owner)  # type: ignore[assignment]
    servicer.owners[record.job_id] = record.owner
    servicer.stage_records[record.job_id] = record
    servicer._forget(servicer.finished.add(record.job_id))
    log.error("stage not restored: %s", message, extra={"fields": {"job_id": record.job_id}})
    await servicer._record(
        "stage.recover",
        outcome="failure",
        account=record.owner,
        job_id=record.job_id,
        details={"stage": record.stage, "epoch": record.epoch + 1, "reason": message},
    )


__all__ = ["restore_stages", "token_problem"]
