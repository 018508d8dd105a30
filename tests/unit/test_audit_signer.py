"""The audit signer (services/signer): a service seals its log without ever holding the key, and whoever
breaks into the service cannot get a seal over a rewritten, cut or replaced history.

Every test runs the real signer process (``python -m services.signer``) on real Unix sockets; the
"service" is an ``AuditLog`` in this process talking to it, and the attacker is this test with the
service's powers: it can write the service's files and call the service's socket, nothing else.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from nebula_common.audit import AuditError, AuditLog, SealVerifier, open_service_audit, record_hash
from nebula_common.audit.records import GENESIS_PREV, seal_payload
from nebula_common.audit.remote_signer import RemoteSigner
from nebula_common.audit.signing import PRIVATE_KEY_NAME, PUBLIC_KEY_NAME, AuditSigner
from nebula_common.audit.verify import verify_log, verify_segments
from nebula_common.launcher.process import ServiceProcess, console_command

READY_S = 60.0


class Signer:
    """A signer process sealing the log ``svc``; ``restart`` keeps its directories."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.socket = root / "svc" / "signer" / "signer.sock"
        self.target = f"unix:{self.socket}"
        self.keys = root / "signer"
        self.process: ServiceProcess | None = None

    def start(self) -> Signer:
        env = {
            "NEBULA_SIGNER_CLUSTER_ID": "a",
            "NEBULA_SIGNER_DATA_DIR": str(self.keys),
            "NEBULA_SIGNER_SOCKETS": f"svc={self.socket}",
            "NEBULA_SIGNER_METRICS_PORT": "-1",
        }
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        self.process = ServiceProcess(
            name="signer-a", command=console_command("services.signer"), env=env, log_dir=self.root / "logs"
        )
        self.process.start()
        self.process.wait_ready(READY_S)
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None


@pytest.fixture
def signer(tmp_path: Path) -> Iterator[Signer]:
    running = Signer(tmp_path).start()
    yield running
    running.stop()


def _open(signer: Signer, **kwargs: object) -> AuditLog:
    return open_service_audit(signer.root / "svc", service="svc", cluster="a", signer=signer.target, **kwargs)


def _lines(path: Path) -> list[bytes]:
    return [line for line in path.read_bytes().split(b"\n") if line]


def _rechained(lines: list[bytes], change: int) -> list[bytes]:
    """A perfect rewrite: record ``change`` edited, every hash and prev after it recomputed."""
    out, prev = [], GENESIS_PREV
    for line in lines:
        record = json.loads(line)
        if record["seq"] == change:
            record["details"] = {"rewritten": True}
        record["prev"] = prev
        record["hash"] = record_hash(record)
        prev = record["hash"]
        out.append(json.dumps(record, sort_keys=True, separators=(",", ":")).encode())
    return out


def test_a_log_sealed_by_its_signer_verifies_and_the_service_holds_no_key(signer: Signer) -> None:
    with _open(signer) as audit:
        for number in range(150):
            audit.append("job.step", details={"n": number})
    service_dir = signer.root / "svc"
    assert not (service_dir / PRIVATE_KEY_NAME).exists()
    assert (signer.keys / "svc" / PRIVATE_KEY_NAME).exists()
    verifier = SealVerifier.from_file(service_dir / PUBLIC_KEY_NAME)
    result = verify_log(service_dir / "audit.log", verifier)
    assert result.ok, result.reason
    assert result.sealed_through == result.records > 150


def test_a_rewritten_past_gets_no_new_seal(signer: Signer) -> None:
    log_path = signer.root / "svc" / "audit.log"
    with _open(signer) as audit:
        for number in range(70):
            audit.append("job.step", details={"n": number})
        log_id = audit.log_id
    forged = _rechained(_lines(log_path), change=5)
    head = json.loads(forged[-1])
    thief = RemoteSigner(signer.target)
    try:
        # The whole rewritten chain, from record 1: it does not pass through the head sealed last.
        with pytest.raises(AuditError, match="FAILED_PRECONDITION"):
            thief.sign(seal_payload(log_id, head["seq"], head["hash"], "2026-01-01T00:00:00Z"), forged)
        # Only a new record after the sealed count, chained onto the rewrite: the same.
        assert thief.position.count == head["seq"]
        extra = {**head, "seq": head["seq"] + 1, "prev": head["hash"], "event": "job.step"}
        extra["hash"] = record_hash(extra)
        with pytest.raises(AuditError, match="does not follow"):
            thief.sign(seal_payload(log_id, extra["seq"], extra["hash"], "t"), [json.dumps(extra).encode()])
        # No records at all, asking for the rewritten head: refused as well.
        with pytest.raises(AuditError, match="FAILED_PRECONDITION"):
            thief.sign(seal_payload(log_id, head["seq"], head["hash"], "2026-01-01T00:00:00Z"))
    finally:
        thief.close()
    log_path.write_bytes(b"\n".join(forged) + b"\n")  # and the rewritten file is refused at start
    with pytest.raises(AuditError, match=r"no longer holds|not at the sealed head"):
        _open(signer)


def test_a_cut_or_replaced_log_stops_the_service_and_a_new_log_is_refused(signer: Signer) -> None:
    service_dir = signer.root / "svc"
    with _open(signer) as audit:
        audit.append("job.step")
        old_log = audit.log_id
    (service_dir / "audit.log").rename(service_dir / "elsewhere.log")
    with pytest.raises(AuditError, match=f"sealed log {re.escape(old_log)}"):
        _open(signer)
    # A fresh log signed by hand (as a broken-into service would): refused, it is another log.
    fresh = AuditLog(
        service_dir / "fresh.log", AuditSigner.load_or_create(service_dir / "own"), service="svc", cluster="a"
    )
    fresh.close()
    lines = _lines(service_dir / "fresh.log")
    last = json.loads(lines[-1])
    thief = RemoteSigner(signer.target)
    try:
        with pytest.raises(AuditError, match="cannot take its place"):
            thief.sign(seal_payload(fresh.log_id, last["seq"], last["hash"], last["ts"]), lines)
    finally:
        thief.close()


def test_each_record_is_checked_and_malformed_ones_are_refused(signer: Signer) -> None:
    with _open(signer) as audit:
        audit.append("job.step")
        log_id = audit.log_id
    thief = RemoteSigner(signer.target)
    try:
        count, head = thief.position.count, thief.position.head
        record = {"seq": count + 1, "prev": head, "event": "job.step", "details": {}}
        record["hash"] = "0" * 64  # not its hash
        line = json.dumps(record).encode()
        with pytest.raises(AuditError, match="does not hash"):
            thief.sign(seal_payload(log_id, count + 1, "0" * 64, "t"), [line])
        with pytest.raises(AuditError, match="INVALID_ARGUMENT"):
            thief.sign(seal_payload(log_id, count + 1, "0" * 64, "t"), [b"{not json"])
        record["hash"] = record_hash(record)
        genuine = json.dumps(record).encode()
        skipping = dict(record, seq=count + 2)
        skipping["hash"] = record_hash(skipping)
        with pytest.raises(AuditError, match="does not follow"):
            thief.sign(
                seal_payload(log_id, count + 2, skipping["hash"], "t"), [json.dumps(skipping).encode()]
            )
        # The genuine next record is sealed: a thief may append, never rewrite.
        assert thief.sign(seal_payload(log_id, count + 1, record["hash"], "t"), [genuine])
        # The same request again (its answer lost to a killed signer): sealed again, nothing skipped.
        assert thief.sign(seal_payload(log_id, count + 1, record["hash"], "t"), [genuine])
        tampered = dict(record, details={"changed": True})
        tampered["hash"] = record_hash(tampered)
        with pytest.raises(AuditError, match="not the record sealed last"):
            thief.sign(
                seal_payload(log_id, count + 1, tampered["hash"], "t"), [json.dumps(tampered).encode()]
            )
    finally:
        thief.close()


CRASHING_SERVICE = """
import sys, time
from nebula_common.audit import open_service_audit
audit = open_service_audit(sys.argv[1], service="svc", cluster="a", signer=sys.argv[2], seal_every=1000,
                           seal_interval_s=3600)
for n in range(5):
    audit.append("job.step", details={"n": n})
print("written", flush=True)
time.sleep(3600)
"""


def test_records_written_before_a_crash_are_sealed_after_the_restart(signer: Signer) -> None:
    service_dir = signer.root / "svc"
    crashing = subprocess.Popen(
        [sys.executable, "-c", CRASHING_SERVICE, str(service_dir), signer.target], stdout=subprocess.PIPE
    )
    try:
        assert crashing.stdout is not None
        assert crashing.stdout.readline() == b"written\n"
    finally:
        crashing.send_signal(signal.SIGKILL)
        crashing.wait(timeout=30)
    unsealed = RemoteSigner(signer.target)
    sealed_before = unsealed.position.count
    unsealed.close()
    with _open(signer) as audit:  # the restart sends the 6 unsealed records with its first seal
        audit.append("service.start")
    result = verify_log(service_dir / "audit.log", SealVerifier.from_file(service_dir / PUBLIC_KEY_NAME))
    assert result.ok, result.reason
    assert result.sealed_through == result.records > sealed_before + 6


def test_a_restarted_signer_holds_the_service_to_the_same_chain(signer: Signer) -> None:
    service_dir = signer.root / "svc"
    with _open(signer) as audit:
        audit.append("job.step")
    signer.stop()
    signer.start()
    with _open(signer) as audit:
        audit.append("job.step")
    assert verify_log(service_dir / "audit.log", SealVerifier.from_file(service_dir / PUBLIC_KEY_NAME)).ok
    os.replace(service_dir / "audit.log", service_dir / "gone.log")
    signer.stop()
    signer.start()
    with pytest.raises(AuditError, match="cut short or replaced"):
        _open(signer)


def test_rotated_segments_are_sealed_across_rotations(signer: Signer) -> None:
    log_path = signer.root / "svc" / "audit.log"
    audit = AuditLog(
        log_path, RemoteSigner(signer.target), service="svc", cluster="a", seal_every=8, segment_bytes=4096
    )
    with audit:
        for number in range(120):
            audit.append("job.step", details={"n": number, "pad": "x" * 100})
    assert (log_path.parent / "audit.log.2").exists()
    result = verify_segments(log_path, SealVerifier.from_pem(audit.public_pem()))
    assert result.ok, result.reason


def test_a_service_that_still_holds_its_own_key_is_refused_at_start(signer: Signer) -> None:
    service_dir = signer.root / "svc"
    AuditSigner.load_or_create(service_dir)  # a key of its own, as before the signer
    with pytest.raises(AuditError, match=PRIVATE_KEY_NAME):
        _open(signer)


def test_a_socket_deeper_than_the_kernels_path_limit_works(tmp_path: Path) -> None:
    deep = Signer(tmp_path / ("d" * 120)).start()
    try:
        assert len(str(deep.socket)) > 108
        with _open(deep) as audit:
            audit.append("job.step")
    finally:
        deep.stop()
