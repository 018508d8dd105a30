"""The audit log: real files, real signatures; every kind of tampering must be caught and located."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nebula_common.audit import (
    AuditError,
    AuditFilter,
    AuditLog,
    AuditSigner,
    SealVerifier,
    open_service_audit,
    query_log,
    record_hash,
    verify_log,
)
from nebula_common.cli.app import app

pytestmark = pytest.mark.timeout(60)


def _write_log(directory: Path, events: int = 10, seal_every: int = 4) -> Path:
    with open_service_audit(directory, service="switch", cluster="a", seal_every=seal_every) as audit:
        for i in range(events):
            audit.append("link.transfer", account=f"user{i % 3}", job_id=f"job{i % 2}", details={"step": i})
    return directory / "audit.log"


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def _verifier(directory: Path) -> SealVerifier:
    return SealVerifier.from_file(directory / "audit-key.pub.pem")


def test_intact_log_verifies_and_is_sealed_at_close(tmp_path: Path) -> None:
    log = _write_log(tmp_path)
    result = verify_log(log, _verifier(tmp_path))
    assert result.ok, result
    records = [json.loads(line) for line in _lines(log)]
    assert [r["seq"] for r in records] == list(range(1, len(records) + 1))
    assert records[0]["event"] == "audit.open"
    # 1 open + 10 events + seals after every 4 non-seal records + the final seal at close.
    assert sum(r["event"] == "audit.seal" for r in records) == 3
    assert records[-1]["event"] == "audit.seal"
    assert result.sealed_through == result.records  # graceful close leaves no unsealed tail
    assert all(record_hash(r) == r["hash"] for r in records)


# Line 7 (index 6) is an ordinary event between the first two seals (lines 5 and 10).
K = 6


def _edit(lines: list[bytes]) -> list[bytes]:
    record = json.loads(lines[K])
    record["account"] = "someone-else"
    return [*lines[:K], (json.dumps(record) + "\n").encode(), *lines[K + 1 :]]


def _delete(lines: list[bytes]) -> list[bytes]:
    return [*lines[:K], *lines[K + 1 :]]


def _reorder(lines: list[bytes]) -> list[bytes]:
    return [*lines[:K], lines[K + 1], lines[K], *lines[K + 2 :]]


def _insert(lines: list[bytes]) -> list[bytes]:
    forged = json.loads(lines[K])
    forged["details"] = {"step": 999}
    forged["hash"] = record_hash(forged)
    return [*lines[:K], (json.dumps(forged) + "\n").encode(), *lines[K:]]


def _truncate_records(lines: list[bytes]) -> list[bytes]:
    return lines[:-3]


def _truncate_mid_record(lines: list[bytes]) -> list[bytes]:
    return [*lines[:-1], lines[-1][:20]]


@pytest.mark.parametrize(
    ("tamper", "first_bad", "words"),
    [
        (_edit, K + 1, "edited"),
        (_delete, K + 1, "deleted, inserted or reordered"),
        (_reorder, K + 1, "deleted, inserted or reordered"),
        (_insert, K + 1, "inserted"),
        (_truncate_mid_record, None, "incomplete"),
        (_truncate_records, None, "truncated"),
    ],
    ids=["edit", "delete", "reorder", "insert", "truncate-mid-record", "truncate-records"],
)
def test_every_kind_of_tampering_is_detected_and_located(
    tmp_path: Path, tamper: Callable[[list[bytes]], list[bytes]], first_bad: int | None, words: str
) -> None:
    log = _write_log(tmp_path)
    original = _lines(log)
    log.write_bytes(b"".join(tamper(original)))
    result = verify_log(log, _verifier(tmp_path))
    assert not result.ok
    assert words in result.reason, result.reason
    expected = first_bad if first_bad is not None else len(tamper(original))
    if tamper is _truncate_records:
        expected = len(original) - 2  # the first record that is gone
    assert result.first_bad == expected, result

    # The CLI says the same, names the record, and exits 1; with --json as one document.
    outcome = CliRunner().invoke(app, ["audit", "verify", str(log)])
    assert outcome.exit_code == 1
    assert f"first bad record: {expected}" in " ".join(outcome.output.split())
    as_json = CliRunner().invoke(app, ["audit", "verify", str(log), "--json"])
    assert as_json.exit_code == 1
    verdict = json.loads(as_json.output)
    assert (verdict["ok"], verdict["first_bad"], verdict["log"]) == (False, expected, str(log))


def test_rewrite_with_recomputed_hashes_is_caught_by_the_seal(tmp_path: Path) -> None:
    """An attacker who rehashes the whole chain after an edit still cannot forge the seal."""
    log = _write_log(tmp_path)
    records = [json.loads(line) for line in _lines(log)]
    records[2]["account"] = "nobody"
    prev = records[1]["hash"]
    for record in records[2:]:
        record["prev"] = prev
        if record["event"] == "audit.seal":
            record["details"]["head"] = prev
        record["hash"] = record_hash(record)
        prev = record["hash"]
    log.write_bytes(b"".join((json.dumps(r) + "\n").encode() for r in records))
    result = verify_log(log, _verifier(tmp_path))
    assert not result.ok
    assert result.first_bad == 1  # nothing since the start (no earlier seal) can be trusted
    assert "no valid signature" in result.reason


def test_log_signed_by_another_key_is_refused(tmp_path: Path) -> None:
    log = _write_log(tmp_path / "real")
    other = AuditSigner.load_or_create(tmp_path / "other").verifier()
    result = verify_log(log, other)
    assert not result.ok
    assert "no valid signature" in result.reason


def test_rolled_back_or_missing_seal_file_is_detected(tmp_path: Path) -> None:
    directory = tmp_path / "svc"
    with open_service_audit(directory, service="auth", cluster="a", seal_every=2) as audit:
        audit.append("login", account="alice")
        audit.append("login", account="alice")
        old_seal = audit.seal_path.read_bytes()
        audit.append("login", account="bob")
        audit.append("login", account="bob")
    log = directory / "audit.log"
    (directory / "audit.log.seal").write_bytes(old_seal)
    result = verify_log(log, _verifier(directory))
    assert not result.ok and "rolled back" in result.reason
    (directory / "audit.log.seal").unlink()
    result = verify_log(log, _verifier(directory))
    assert not result.ok and "missing" in result.reason


def test_stale_seal_fails_with_max_age(tmp_path: Path) -> None:
    log = _write_log(tmp_path)
    later = datetime.now(UTC) + timedelta(hours=1)
    assert verify_log(log, _verifier(tmp_path), max_seal_age=timedelta(minutes=5), now=later).ok is False
    assert verify_log(log, _verifier(tmp_path), max_seal_age=timedelta(hours=2), now=later).ok


def test_reopen_continues_the_chain_and_a_second_writer_is_refused(tmp_path: Path) -> None:
    _write_log(tmp_path, events=3)
    with open_service_audit(tmp_path, service="switch", cluster="a") as audit:
        with pytest.raises(AuditError, match="already open by another process"):
            AuditLog(audit.path, AuditSigner.load_or_create(tmp_path), service="x", cluster="a")
        audit.append("link.up")
    records = [json.loads(line) for line in _lines(tmp_path / "audit.log")]
    assert sum(r["event"] == "audit.open" for r in records) == 2
    assert records[-3]["details"]["resumed"] is True
    assert verify_log(tmp_path / "audit.log", _verifier(tmp_path)).ok


def test_torn_last_line_stops_the_writer_with_a_clear_error(tmp_path: Path) -> None:
    log = _write_log(tmp_path, events=2)
    log.write_bytes(log.read_bytes() + b'{"seq": 9')
    with pytest.raises(AuditError, match="unreadable record"):
        open_service_audit(tmp_path, service="switch", cluster="a")


def test_periodic_seal_covers_records_without_further_appends(tmp_path: Path) -> None:
    audit = open_service_audit(tmp_path, service="switch", cluster="a", seal_every=1000, seal_interval_s=0.2)
    try:
        audit.append("link.up")
        import time

        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            result = verify_log(audit.path, _verifier(tmp_path))
            if result.ok and result.sealed_through >= 2:
                break
            time.sleep(0.05)
        assert result.ok and result.sealed_through >= 2, result
    finally:
        audit.close()


def test_bad_input_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    with open_service_audit(tmp_path, service="switch", cluster="a") as audit:
        before = audit.path.read_bytes()
        with pytest.raises(ValueError, match="outcome"):
            audit.append("login", outcome="maybe")
        with pytest.raises(ValueError, match="event name"):
            audit.append("")
        assert audit.path.read_bytes() == before
    with pytest.raises(ValueError, match="seal_every"):
        open_service_audit(tmp_path / "x", service="s", cluster="a", seal_every=0)


def test_query_filters_by_account_job_event_and_time(tmp_path: Path) -> None:
    log = _write_log(tmp_path, events=12)
    by_account = query_log(log, AuditFilter(account="user1"))
    assert {r["account"] for r in by_account.records} == {"user1"} and len(by_account.records) == 4
    by_job = query_log(log, AuditFilter(job_id="job0", event="link."))
    assert len(by_job.records) == 6 and all(r["event"] == "link.transfer" for r in by_job.records)
    assert query_log(log, AuditFilter(event="link")).records == []
    future = datetime.now(UTC).timestamp() + 60
    assert query_log(log, AuditFilter(since_unix=future)).records == []
    assert len(query_log(log, AuditFilter(until_unix=future)).records) == by_account.total_records
    limited = query_log(log, AuditFilter(), limit=3)
    assert len(limited.records) == 3 and limited.truncated
    outcome = CliRunner().invoke(app, ["audit", "show", str(log), "--account", "user2"])
    assert outcome.exit_code == 0
    assert [json.loads(line)["account"] for line in outcome.output.splitlines()] == ["user2"] * 4


def test_cli_verify_ok_and_pinned_key(tmp_path: Path) -> None:
    log = _write_log(tmp_path)
    key_id = _verifier(tmp_path).key_id
    ok = CliRunner().invoke(app, ["audit", "verify", str(log), "--expect-key-id", key_id])
    assert ok.exit_code == 0, ok.output
    assert "OK" in ok.output and "0 later record(s)" in " ".join(ok.output.split())
    wrong = CliRunner().invoke(app, ["audit", "verify", str(log), "--expect-key-id", "0" * 16])
    assert wrong.exit_code == 1
    as_json = CliRunner().invoke(app, ["audit", "verify", str(log), "--json"])
    assert as_json.exit_code == 0, as_json.output
    verdict = json.loads(as_json.output)
    assert verdict["ok"] is True and verdict["key_id"] == key_id and verdict["records"] > 0
