"""Stage records on a trainer's disk: written safely, read back, damaged ones skipped, and restored.

The resume of a running stage itself (a real runner at the next epoch, negotiating with its peer) is
covered end to end by ``tests/integration/test_trainer_restart.py``; here: the records, the stages
that had ended, a token that no longer verifies, and a damaged record next to good ones.
"""

from __future__ import annotations

import asyncio
import json
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nebula_common.audit import AuditLog
from nebula_common.auth import Principal, TokenVerifier
from nebula_common.auth.interceptor import _CALLER, Caller
from nebula_common.jobspec import load_spec
from nebula_common.jobspec.builtin import builtin_spec
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.jobs import ProgramJob
from services.auth.tokens import TokenIssuer
from services.trainer.records import RECORDS_DIR, FinishedStage, StageRecords
from services.trainer.restore import restore_stages, token_problem
from services.trainer.servicer import TrainerServicer
from services.trainer.status import StatusBoard
from tests.support.trainer_audit import trainer_audit

pytestmark = pytest.mark.timeout(30)


def stage_spec(job_id: str = "job-1") -> trainer_pb2.StageSpec:
    loaded = load_spec(builtin_spec("numbers"), {"steps": 3})
    return ProgramJob(loaded, job_id=job_id).stage_spec("encoder")


@pytest.fixture
def issuer(tmp_path: Path) -> TokenIssuer:
    return TokenIssuer(tmp_path / "auth", "a", ttl_seconds=600)


@pytest.fixture
def verifier(issuer: TokenIssuer) -> TokenVerifier:
    return TokenVerifier("a", json.dumps(issuer.jwks()))


@pytest.fixture
def audit(tmp_path: Path) -> Iterator[AuditLog]:
    log = trainer_audit(tmp_path)
    yield log
    log.close()


def audit_events(audit: AuditLog) -> list[dict]:
    return [json.loads(line) for line in audit.path.read_text().splitlines()]


def test_a_record_is_private_atomic_and_round_trips(tmp_path: Path) -> None:
    records = StageRecords(tmp_path)
    record = records.create(stage_spec(), "token-of-alice", "alice")
    assert record.path == tmp_path / RECORDS_DIR / "alice" / "job-1.json"
    assert stat.S_IMODE(record.path.stat().st_mode) == 0o600  # it holds the owner's token
    for directory in (tmp_path / RECORDS_DIR, record.path.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert [p.name for p in record.path.parent.iterdir()] == ["job-1.json"]  # no temp file left
    (back,) = records.load_all()
    assert (back.owner, back.job_id, back.stage, back.token, back.epoch) == (
        "alice",
        "job-1",
        "encoder",
        "token-of-alice",
        0,
    )
    assert back.spec == stage_spec() and not back.terminal


def test_the_epoch_is_stored_before_use_and_never_goes_back(tmp_path: Path) -> None:
    records = StageRecords(tmp_path)
    record = records.create(stage_spec(), "t", "alice")
    records.set_epoch(record, 2)
    records.set_epoch(record, 1)  # late, out of order: ignored
    (back,) = records.load_all()
    assert back.epoch == 2 and back.state == trainer_pb2.STAGE_STATE_RECOVERING


def test_an_ended_stage_keeps_its_final_status_and_drops_its_token(tmp_path: Path) -> None:
    records = StageRecords(tmp_path)
    record = records.create(stage_spec(), "secret-token", "alice")
    final = trainer_pb2.StageStatus(
        job_id="job-1", stage="encoder", state=trainer_pb2.STAGE_STATE_SUCCEEDED, steps_done=3
    )
    records.finish(record, final)
    records.set_epoch(record, 5)  # after the end: ignored
    assert "secret-token" not in record.path.read_text()
    (back,) = records.load_all()
    assert back.terminal and back.final == final and back.epoch == 0


def test_a_stage_whose_final_status_is_out_shows_an_end_before_its_record_stores_it(tmp_path: Path) -> None:
    """ListStages between the final status and its finish callback: ended now, never 0."""
    records = StageRecords(tmp_path)
    record = records.create(stage_spec(), "secret-token", "alice")
    running = trainer_pb2.StageStatus(job_id="job-1", stage="encoder", state=trainer_pb2.STAGE_STATE_RUNNING)
    assert record.info(running).ended_unix == 0
    final = trainer_pb2.StageStatus(job_id="job-1", stage="encoder", state=trainer_pb2.STAGE_STATE_CANCELLED)
    shown = record.info(final).ended_unix
    assert record.started_unix <= shown <= time.time() + 0.001  # both rounded to the millisecond
    records.finish(record, final)
    assert record.info(final).ended_unix == record.ended_unix > 0


def test_a_finished_stage_record_keeps_the_last_steps_loss_and_step_time(tmp_path: Path) -> None:
    records = StageRecords(tmp_path)
    record = records.create(stage_spec(), "secret-token", "alice")
    board = StatusBoard("job-1", "decoder")
    board.update(state=trainer_pb2.STAGE_STATE_RUNNING)
    for step in (1, 2, 3):
        board.update(steps_done=step, loss=2.0 / step, step_seconds=0.1 * step)
    board.update(state=trainer_pb2.STAGE_STATE_SUCCEEDED)
    records.store_end(record, board)  # what the stage thread does as it ends
    (back,) = StageRecords(tmp_path).load_all()  # as a restarted trainer, or `job list` on a stopped run
    assert back.final.HasField("loss"), "the stored final status lost the last step's loss"
    assert (back.final.steps_done, back.final.loss, back.final.step_seconds) == (3, 2.0 / 3, 0.1 * 3)
    assert back.info(back.final).status.loss == 2.0 / 3  # what ListStages shows of it


def test_a_finished_stage_with_per_edge_counters_is_restored_by_a_restarted_trainer(tmp_path: Path) -> None:
    """A stage that ended with per-edge traffic (repeated ``edges``) comes back as a FinishedStage.

    The restarted trainer once crashed in a loop here ("Assignment not allowed to ... repeated field
    'edges'"): the board set the repeated field with ``setattr``.
    """
    records = StageRecords(tmp_path)
    record = records.create(stage_spec(), "secret-token", "alice")
    board = StatusBoard("job-1", "decoder")
    board.update(state=trainer_pb2.STAGE_STATE_RUNNING)
    edge = trainer_pb2.EdgeTraffic(edge="encoder->decoder", bytes_sent=10, frames_sent=1)
    board.update(steps_done=1, loss=1.5, edges=[edge])
    board.update(state=trainer_pb2.STAGE_STATE_SUCCEEDED)
    records.store_end(record, board)
    (back,) = StageRecords(tmp_path).load_all()
    restored = FinishedStage(back.final, back.owner)
    final = restored.board.latest()
    assert list(final.edges) == [edge] and final.loss == 1.5
    assert final.state == trainer_pb2.STAGE_STATE_SUCCEEDED


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: p.write_bytes(b"\x00\xff{"), "not JSON"),
        (lambda p: p.write_text("[1, 2]"), "not a JSON object"),
        (lambda p: p.write_text(json.dumps({"format": 1})), "field 'owner'"),
        (lambda p: _edit(p, epoch=-1), "field 'epoch'"),
        (lambda p: _edit(p, state="STAGE_STATE_BORED"), "not a stage state"),
        (lambda p: _edit(p, spec="not base64!"), "field 'spec'"),
        (lambda p: _edit(p, token=""), "field 'token'"),
        (lambda p: _edit(p, job_id="job-2"), "spec is for job 'job-1'"),
        (lambda p: _edit(p, owner="bob"), "names owner 'bob' job 'job-1', but lies at alice/job-1.json"),
        (lambda p: _edit(p, format=9), "format 9"),
        (lambda p: _edit(p, started_unix="soon"), "field 'started_unix'"),
        (lambda p: _edit(p, steps=-3), "field 'steps'"),
    ],
)
def test_a_damaged_record_is_skipped_audited_and_the_others_load(
    tmp_path: Path, audit: AuditLog, damage: Callable[[Path], object], reason: str
) -> None:
    records = StageRecords(tmp_path, audit)
    bad = records.create(stage_spec("job-1"), "t", "alice")
    records.create(stage_spec("job-3"), "t", "alice")
    damage(bad.path)
    assert [r.job_id for r in records.load_all()] == ["job-3"]
    (event,) = [e for e in audit_events(audit) if e["event"] == "stage.record"]
    assert event["outcome"] == "failure" and event["job_id"] == "job-1" and event["account"] == "alice"
    assert reason in event["details"]["reason"]


def _edit(path: Path, **fields: object) -> None:
    body = json.loads(path.read_text())
    body.update(fields)
    path.write_text(json.dumps(body))


def test_a_token_that_no_longer_verifies_is_named(
    tmp_path: Path, issuer: TokenIssuer, verifier: TokenVerifier
) -> None:
    records = StageRecords(tmp_path)
    fresh = records.create(stage_spec(), issuer.issue("alice", "user").token, "alice")
    assert token_problem(verifier, fresh) is None
    old = issuer.issue("alice", "user", now=time.time() - 3600)
    expired = records.create(stage_spec("job-2"), old.token, "alice")
    at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(old.expires_at))
    assert token_problem(verifier, expired) == f"token expired at {at}"
    foreign = records.create(stage_spec("job-3"), issuer.issue("mallory", "user").token, "alice")
    assert token_problem(verifier, foreign) == "token is 'mallory''s, the stage is 'alice''s"


def test_restore_gives_back_ended_stages_and_fails_an_expired_one_with_its_reason(
    tmp_path: Path, audit: AuditLog, issuer: TokenIssuer, verifier: TokenVerifier
) -> None:
    data_dir = tmp_path / "trainer"
    before = StageRecords(data_dir)
    done = before.create(stage_spec("job-1"), "t", "alice")
    final = trainer_pb2.StageStatus(
        job_id="job-1", stage="encoder", state=trainer_pb2.STAGE_STATE_CANCELLED, message="cancelled"
    )
    before.finish(done, final)
    old = issuer.issue("bob", "user", now=time.time() - 3600).token
    before.create(stage_spec("job-2"), old, "bob")

    servicer = TrainerServicer("a", "127.0.0.1:1", data_dir, audit)
    counts = asyncio.run(restore_stages(servicer, verifier))
    assert counts == {"resumed": 0, "ended": 1, "failed": 1}
    assert servicer.owners == {"job-1": "alice", "job-2": "bob"}
    assert servicer.runners["job-1"].board.latest() == final
    failed = servicer.runners["job-2"].board.latest()
    assert failed.state == trainer_pb2.STAGE_STATE_FAILED
    assert failed.message.startswith(
        "cannot resume after the trainer restarted: the owner's token expired at"
    )
    (event,) = [e for e in audit_events(audit) if e["event"] == "stage.recover"]
    assert event["outcome"] == "failure" and event["job_id"] == "job-2"
    # ... and it stays failed across the next restart, without its token
    (again,) = [r for r in StageRecords(data_dir).load_all() if r.job_id == "job-2"]
    assert again.terminal and again.token == "" and again.final == failed


def test_a_record_written_before_the_listing_fields_still_loads(tmp_path: Path) -> None:
    records = StageRecords(tmp_path)
    record = records.create(stage_spec(), "t", "alice")
    body = json.loads(record.path.read_text())
    for key in ("spec_digest", "steps", "edge", "started_unix", "ended_unix"):
        del body[key]
    record.path.write_text(json.dumps(body))
    (back,) = records.load_all()
    assert (back.spec_digest, back.steps, back.edge, back.started_unix) == ("", 0, "", 0.0)


def list_stages(
    servicer: TrainerServicer, username: str, role: str = "user"
) -> list[trainer_pb2.StageRecordInfo]:
    """``ListStages`` as ``username`` calls it (the caller the token interceptor would have verified)."""

    async def call() -> list[trainer_pb2.StageRecordInfo]:
        _CALLER.set(Caller(Principal(username, role, "a"), "token"))
        response = await servicer.ListStages(trainer_pb2.ListStagesRequest(), None)  # type: ignore[arg-type]
        return list(response.stages)

    return asyncio.run(call())


def test_list_stages_after_a_restart_shows_owners_their_stages_and_admins_all(
    tmp_path: Path, audit: AuditLog, verifier: TokenVerifier
) -> None:
    data_dir = tmp_path / "trainer"
    before = StageRecords(data_dir)
    ended = {}
    for job_id, owner in (("job-1", "alice"), ("job-2", "bob")):
        spec = stage_spec(job_id)
        record = before.create(spec, "t", owner)
        assert record.spec_digest == spec.spec_digest and len(spec.spec_digest) == 64
        final = trainer_pb2.StageStatus(
            job_id=job_id, stage="encoder", state=trainer_pb2.STAGE_STATE_SUCCEEDED, steps_done=3
        )
        before.finish(record, final)
        ended[job_id] = (record, final)

    servicer = TrainerServicer("a", "127.0.0.1:1", data_dir, audit)
    assert asyncio.run(restore_stages(servicer, verifier)) == {"resumed": 0, "ended": 2, "failed": 0}
    (mine,) = list_stages(servicer, "alice")
    record, final = ended["job-1"]
    assert mine.status == final and mine.owner == "alice" and mine.spec_digest == record.spec_digest
    assert (mine.steps, mine.edge) == (3, "encoder->decoder")
    assert 0 < mine.started_unix <= mine.ended_unix <= time.time()
    assert [i.status.job_id for i in list_stages(servicer, "admin", "admin")] == ["job-1", "job-2"]
    assert list_stages(servicer, "mallory") == []  # another account's stages are not even listed
