"""Witnessed audit: a log rewritten after the peer witnessed its head is caught, even when re-signed.

The attacker here holds the log's signing key (it broke into the service, which can read it): it
rewrites an old record, recomputes the whole hash chain after it and re-signs every seal and the seal
file. ``nebula audit verify`` with the pinned key cannot tell (that is what the key allows); with the
peer switch's log as witness it names the rewrite. Cutting the log short is caught the same way, and a
peer whose head goes back is recorded as refused at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from nebula_common.audit import AuditLog, AuditSigner, open_service_audit, record_hash, verify_log
from nebula_common.audit.records import SEAL_EVENT, seal_payload
from nebula_common.audit.segments import seal_path_for
from nebula_common.audit.signing import canonical_json
from nebula_common.audit.witness import WITNESS_EVENT, check_witnessed
from nebula_common.cli.audit import app
from nebula_common.proto.nebula.v1 import link_pb2
from services.switch.witness import AuditWitness


def _recorder(audit: AuditLog) -> Any:
    def record(event: str, *, outcome: str = "ok", **details: object) -> None:
        audit.append(event, outcome=outcome, details=details)

    return record


def _witnessed_pair(tmp_path: Path) -> tuple[Path, Path]:
    """Switch a's log (30 records before the head b witnessed, 5 after) and switch b's, both closed."""
    a = open_service_audit(tmp_path / "a", service="switch", cluster="a", seal_every=8)
    b = open_service_audit(tmp_path / "b", service="switch", cluster="b", seal_every=8)
    sender, receiver = AuditWitness(a, "b", _recorder(a)), AuditWitness(b, "a", _recorder(b))
    for number in range(25):
        a.append("edge.open", account="alice", job_id=f"job-{number}", details={"edge": "e"})
    head = sender.due(now=0.0)
    assert head is not None and head.audit_head.count >= 25
    assert sender.due(now=1.0) is None  # not again within the interval
    receiver.received(head.audit_head)
    for number in range(5):
        a.append("edge.close", job_id=f"job-{number}")
    a.close()
    b.close()
    return a.path, b.path


def _rewrite_and_resign(log: Path, key_dir: Path, seq: int) -> None:
    """What an intruder with the signing key can do: edit record ``seq``, re-chain, re-sign every seal."""
    signer = AuditSigner.load_or_create(key_dir)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    records[seq - 1]["account"] = "nobody"
    log_id = records[0]["details"]["log_id"]
    for index in range(seq - 1, len(records)):
        record = records[index]
        record["prev"] = records[index - 1]["hash"]
        if record["event"] == SEAL_EVENT:
            details = record["details"]
            details["head"] = records[index - 1]["hash"]
            details["sig"] = signer.sign(
                seal_payload(log_id, details["count"], details["head"], details["sealed_at"])
            )
        record.pop("hash")
        record["hash"] = record_hash(record)
    log.write_text("".join(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n" for r in records))
    last = records[-1]
    outer = seal_payload(log_id, last["seq"], last["hash"], last["ts"])
    document = {**outer, "v": 1, "key_id": signer.key_id, "sig": signer.sign(outer)}
    seal_path_for(log).write_bytes(canonical_json(document) + b"\n")


def test_the_log_as_witnessed_verifies(tmp_path: Path) -> None:
    log, witness = _witnessed_pair(tmp_path)
    result = check_witnessed(log, witness)
    assert result.ok, result.reason
    assert (result.heads, result.witness) == (1, "switch/b")
    assert result.witnessed_through >= 25
    done = CliRunner().invoke(app, ["verify", str(log), "--witness", str(witness)])
    assert done.exit_code == 0, done.output
    assert "WITNESSED" in done.output and "switch/b" in done.output


def test_a_rewritten_and_resigned_log_passes_its_key_but_not_its_witness(tmp_path: Path) -> None:
    log, witness = _witnessed_pair(tmp_path)
    _rewrite_and_resign(log, tmp_path / "a", seq=10)
    signer = AuditSigner.load_or_create(tmp_path / "a")
    assert verify_log(log, signer.verifier()).ok  # the key holder's rewrite is invisible to the seals
    result = check_witnessed(log, witness)
    assert not result.ok and result.reason.startswith("REWRITTEN"), result
    done = CliRunner().invoke(app, ["verify", str(log), "--witness", str(witness)])
    assert done.exit_code == 1
    assert "NOT AS WITNESSED" in done.output and "REWRITTEN" in done.output
    as_json = CliRunner().invoke(app, ["verify", str(log), "--witness", str(witness), "--json"])
    assert as_json.exit_code == 1
    assert json.loads(as_json.output)["witness"]["ok"] is False


def test_a_rewrite_after_the_newest_witnessed_head_is_not_claimed_as_caught(tmp_path: Path) -> None:
    """Records after the newest head are protected by the seals only: the witness says how far it goes."""
    log, witness = _witnessed_pair(tmp_path)
    through = check_witnessed(log, witness).witnessed_through
    _rewrite_and_resign(log, tmp_path / "a", seq=through + 2)
    result = check_witnessed(log, witness)
    assert result.ok and result.witnessed_through == through


def test_a_log_cut_short_of_a_witnessed_head_is_caught(tmp_path: Path) -> None:
    log, witness = _witnessed_pair(tmp_path)
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join(lines[:20]))
    result = check_witnessed(log, witness)
    assert not result.ok and result.reason.startswith("TRUNCATED"), result


def test_a_witness_that_saw_nothing_of_the_log_proves_nothing(tmp_path: Path) -> None:
    log, _ = _witnessed_pair(tmp_path)
    other = open_service_audit(tmp_path / "c", service="switch", cluster="c")
    other.close()
    result = check_witnessed(log, other.path)
    assert not result.ok and "witnessed no head" in result.reason
    done = CliRunner().invoke(app, ["verify", str(log), "--witness", str(tmp_path / "missing.log")])
    assert done.exit_code == 1 and "cannot read the witness log" in done.output


@pytest.mark.parametrize(
    ("count", "head", "problem"),
    [(10, "x" * 64, "went back from 20 to 10"), (20, "y" * 64, "record 20 of the peer's audit log changed")],
)
def test_a_peer_head_that_goes_back_is_recorded_as_refused(
    tmp_path: Path, count: int, head: str, problem: str
) -> None:
    b = open_service_audit(tmp_path / "b", service="switch", cluster="b")
    receiver = AuditWitness(b, "a", _recorder(b))
    receiver.received(link_pb2.AuditHead(log_id="L", count=20, head="h" * 64, read_at="t"), now=0.0)
    receiver.received(link_pb2.AuditHead(log_id="L", count=count, head=head, read_at="t"), now=60.0)
    b.close()
    records = [json.loads(line) for line in b.path.read_text().splitlines()]
    witnessed = [r for r in records if r["event"] == WITNESS_EVENT]
    assert [r["outcome"] for r in witnessed] == ["ok", "refused"]
    assert problem in witnessed[1]["details"]["reason"]


def test_a_peer_flooding_heads_gets_one_recorded_per_half_interval(tmp_path: Path) -> None:
    """A hostile peer cannot fill this switch's audit log (and rotate its history out) with heads."""
    b = open_service_audit(tmp_path / "b", service="switch", cluster="b")
    receiver = AuditWitness(b, "a", _recorder(b))
    for n in range(1000):
        head = link_pb2.AuditHead(log_id="L", count=n + 1, head="h" * 64, read_at="t")
        receiver.received(head, now=100.0 + n * 0.01)  # 10 s of heads, one every 10 ms
    b.close()
    witnessed = [json.loads(line) for line in b.path.read_text().splitlines() if WITNESS_EVENT in line]
    assert len(witnessed) == 1  # the product's interval is 60 s: one head per 30 s at most
    assert receiver.dropped == 999
