"""Audit logs rotate at a size and keep a bounded number of segments, with the chain running through.

A log that grows past its segment size is sealed and moved to ``<log>.1`` (older segments move up, the
oldest beyond the kept number is deleted), and the new file's first record says which seq and hash it
continues. So the disk a log takes is bounded, ``nebula audit verify`` still checks every record kept
(and that no segment in between was removed or swapped), a witness still proves the kept records, and
queries read across segments. Small segments here; the product's are 64 MiB, 8 kept.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from typer.testing import CliRunner

from nebula_common.audit import AuditFilter, AuditLog, AuditSigner, query_log
from nebula_common.audit.log import SEGMENT_BYTES, SEGMENTS_KEPT
from nebula_common.audit.segments import seal_path_for, segment_path, segments
from nebula_common.audit.verify import verify_segments
from nebula_common.audit.witness import check_witnessed
from nebula_common.cli.audit import app

SEGMENT, KEPT = 8 << 10, 3


def _log(directory: Path) -> AuditLog:
    return AuditLog(
        directory / "audit.log",
        AuditSigner.load_or_create(directory),
        service="switch",
        cluster="a",
        seal_every=16,
        segment_bytes=SEGMENT,
        segments_kept=KEPT,
    )


def _fill(log: AuditLog, records: int) -> None:
    for number in range(records):
        log.append("edge.open", account="alice", job_id=f"job-{number}", details={"edge": "e", "n": number})


def test_a_log_rotates_keeps_a_bounded_number_of_segments_and_verifies_across_them(tmp_path: Path) -> None:
    log = _log(tmp_path)
    _fill(log, 600)
    log.close()
    last = log.records  # the closing seal included
    files = segments(log.path)
    assert [f.name for f in files] == ["audit.log.3", "audit.log.2", "audit.log.1", "audit.log"]
    assert not segment_path(log.path, KEPT + 1).exists()
    assert all(seal_path_for(f).exists() for f in files)
    record_bytes = max(len(line) for f in files for line in f.read_bytes().splitlines(keepends=True))
    # A segment ends with the record that crossed the size, then its seal.
    assert sum(f.stat().st_size for f in files) <= (KEPT + 1) * (SEGMENT + 2 * record_bytes)
    verifier = AuditSigner.load_or_create(tmp_path).verifier()
    result = verify_segments(log.path, verifier)
    assert result.ok, result.reason
    assert result.records == last and result.first_record > 1  # the oldest segments were dropped
    first = json.loads(files[0].read_bytes().splitlines()[0])
    assert first["event"] == "audit.open" and first["details"]["continues"]["seq"] == result.first_record - 1
    done = CliRunner().invoke(app, ["verify", str(log.path)])
    assert done.exit_code == 0, done.output
    assert f"records {result.first_record}..{last} (older segments rotated away)" in done.output
    found = query_log(log.path, AuditFilter(job_id="job-550"))
    assert [r["job_id"] for r in found.records] == ["job-550"]
    assert found.total_records == last - result.first_record + 1


def test_a_restarted_writer_continues_the_chain_and_rotation(tmp_path: Path) -> None:
    log = _log(tmp_path)
    _fill(log, 150)
    log.close()
    again = _log(tmp_path)
    _fill(again, 150)
    again.close()
    assert verify_segments(again.path, AuditSigner.load_or_create(tmp_path).verifier()).ok


def test_a_segment_removed_or_swapped_in_between_is_named(tmp_path: Path) -> None:
    log = _log(tmp_path)
    _fill(log, 600)
    log.close()
    verifier = AuditSigner.load_or_create(tmp_path).verifier()
    middle = segment_path(log.path, 2)
    # Swapped: segment 1 replaced by a copy of segment 2 (both genuine, signed files).
    saved = tmp_path / "saved"
    shutil.copy(segment_path(log.path, 1), saved)
    shutil.copy(seal_path_for(segment_path(log.path, 1)), tmp_path / "saved.seal")
    shutil.copy(middle, segment_path(log.path, 1))
    shutil.copy(seal_path_for(middle), seal_path_for(segment_path(log.path, 1)))
    swapped = verify_segments(log.path, verifier)
    assert not swapped.ok and "does not continue" in swapped.reason, swapped
    shutil.copy(saved, segment_path(log.path, 1))
    shutil.copy(tmp_path / "saved.seal", seal_path_for(segment_path(log.path, 1)))
    assert verify_segments(log.path, verifier).ok
    # Removed: the middle segment gone, the older one moved in to hide the gap.
    middle.unlink()
    seal_path_for(middle).unlink()
    segment_path(log.path, 3).rename(middle)
    seal_path_for(segment_path(log.path, 3)).rename(seal_path_for(middle))
    removed = verify_segments(log.path, verifier)
    assert not removed.ok and "a segment was removed, replaced or reordered" in removed.reason
    done = CliRunner().invoke(app, ["verify", str(log.path)])
    assert done.exit_code == 1 and "TAMPERED" in done.output


def test_an_edit_inside_an_old_segment_is_found(tmp_path: Path) -> None:
    log = _log(tmp_path)
    _fill(log, 600)
    log.close()
    old = segment_path(log.path, 2)
    lines = old.read_bytes().splitlines(keepends=True)
    record = json.loads(lines[5])
    record["account"] = "mallory"
    lines[5] = (json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n").encode()
    old.write_bytes(b"".join(lines))
    result = verify_segments(log.path, AuditSigner.load_or_create(tmp_path).verifier())
    assert not result.ok and result.reason.startswith("audit.log.2: ")
    assert result.first_bad == record["seq"]


def test_witnessed_heads_are_checked_across_segments(tmp_path: Path) -> None:
    log = _log(tmp_path / "a")
    witness = _log(tmp_path / "b")
    for _ in range(6):
        _fill(log, 60)
        log_id, count, head = log.head()
        witness.append("audit.witness", details={"peer": "a", "log_id": log_id, "count": count, "head": head})
    log.close()
    witness.close()
    result = check_witnessed(log.path, witness.path)
    assert result.ok, result.reason
    assert result.witnessed_through == count and result.heads == 6


def test_the_product_bound_is_stated() -> None:
    assert (SEGMENT_BYTES, SEGMENTS_KEPT) == (64 << 20, 8)  # 576 MiB a log, docs/accounts-and-audit.md
