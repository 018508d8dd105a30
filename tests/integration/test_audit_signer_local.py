"""Under `nebula local up` an intruder in a service cannot re-seal its rewritten audit log.

The intruder has the data service's powers: its state directory (where its audit log is) and its
signer socket. It rewrites an early record of the log and re-chains every hash after it (a perfect
rewrite), as whoever held the service's seal key used to be able to and then re-sign. The restarted
service is refused at start by its own log check against the signer's last sealed head, a seal
asked for directly is refused by the signer, and the log fails verification against the key; auth,
beside it, keeps sealing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nebula_common.audit import AuditError, SealVerifier, record_hash
from nebula_common.audit.records import GENESIS_PREV, seal_payload
from nebula_common.audit.remote_signer import RemoteSigner
from nebula_common.audit.verify import verify_log
from nebula_common.launcher import LocalDeployment
from nebula_common.launcher.process import ServiceStartError
from tests.support.accounts import make_user
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.long]

DEADLINE_S = 120.0


def _rewritten(lines: list[bytes]) -> list[bytes]:
    out, prev = [], GENESIS_PREV
    for line in lines:
        record = json.loads(line)
        if record["seq"] == 2:
            record["details"] = {"rewritten": "by an intruder"}
        record["prev"] = prev
        record["hash"] = record_hash(record)
        prev = record["hash"]
        out.append(json.dumps(record, sort_keys=True, separators=(",", ":")).encode())
    return out


def test_an_intruder_in_a_service_cannot_reseal_its_rewritten_log(tmp_path: Path) -> None:
    with LocalDeployment(run_dir=tmp_path / "run", bandwidth_mbit=100.0, delay_ms=5.0) as deployment:
        data_dir = deployment.run_dir / "a" / "data"
        log_path = data_dir / "audit.log"
        verifier = SealVerifier.from_file(data_dir / "audit-key.pub.pem")
        assert not (data_dir / "audit-key.pem").exists()  # the key is the signer's
        data = deployment.process("data-a")
        data.stop()  # sealed as it stops
        sealed = verify_log(log_path, verifier)
        assert sealed.ok and sealed.sealed_through == sealed.records >= 3, sealed

        forged = _rewritten([line for line in log_path.read_bytes().split(b"\n") if line])
        log_path.write_bytes(b"\n".join(forged) + b"\n")
        data.start()
        with pytest.raises(ServiceStartError, match=r"no longer holds|not at the sealed head"):
            data.wait_ready(DEADLINE_S)

        head, first = json.loads(forged[-1]), json.loads(forged[0])
        thief = RemoteSigner(data.env["NEBULA_DATA_AUDIT_SIGNER"])
        try:
            with pytest.raises(AuditError, match="FAILED_PRECONDITION"):
                thief.sign(seal_payload(first["details"]["log_id"], head["seq"], head["hash"], "t"), forged)
        finally:
            thief.close()
        rewritten = verify_log(log_path, verifier)
        assert not rewritten.ok and rewritten.first_bad is not None, rewritten

        # Auth, beside it, keeps sealing with the same signer: a new account, then a sealed stop.
        auth_log = deployment.run_dir / "a" / "auth" / "audit.log"
        auth_key = SealVerifier.from_file(auth_log.parent / "audit-key.pub.pem")
        before = verify_log(auth_log, auth_key)
        make_user(deployment, "a", "carol")
        deployment.process("auth-a").stop()
        after = wait_for(
            lambda: (v := verify_log(auth_log, auth_key)).sealed_through > before.records and v,
            DEADLINE_S,
            "auth's new records sealed",
        )
        assert after.ok and after.sealed_through == after.records, after
