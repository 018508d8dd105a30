"""A switch stopped while an edge is open records that edge's end before its audit log closes.

The failure this guards against: at shutdown ``OpenEdge`` logged ``AuditError: audit log ... is closed``.
gRPC's ``server.stop(grace)`` returns once the core has cancelled the calls still open after the
grace, before their handlers have run their ``finally``; the stack then closed the audit log, so the
edge's ``edge.close`` record either failed with that error or was never written.

Real parts: an auth server and a switch of cluster b, started in-process as their processes start
them; the switch's ``stop`` is the stack unwind SIGTERM runs. A real trainer edge end (gRPC, token)
is open and attached when the switch stops.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from nebula_common.audit import SealVerifier, verify_log
from nebula_common.pki import PkiLayout
from nebula_common.sdk.auth_client import AuthClient
from services.trainer.edge import EdgeConnection, EdgeSettings, GrpcEdgeTransport
from tests.support.accounts import ADMIN_PASSWORD, auth_settings
from tests.support.edges import wait_for
from tests.support.servers import accepting_switch, running_auth

pytestmark = pytest.mark.timeout(90)
JOB = "job-cut-by-stop"


def test_an_edge_open_when_the_switch_stops_is_recorded_before_the_audit_log_closes(
    tmp_path: Path, pki_ab: PkiLayout, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with running_auth(auth_settings(tmp_path, "b")) as auth:
        with AuthClient(auth.address) as client:
            token = client.login("admin", ADMIN_PASSWORD).token
        with accepting_switch(tmp_path, pki_ab.cluster("b"), "a", auth.address) as switch:
            edge = EdgeConnection(
                GrpcEdgeTransport(switch.internal_address, token, JOB, "up->down"),
                job_id=JOB,
                edge="up->down",
                upstream=True,
                settings=EdgeSettings(max_outage_s=60.0, ready_timeout_s=30.0),
            )
            router = switch.running.router
            wait_for(lambda: router.open_routes() == 1, 30, "the edge's route attached on switch b")
            # Leaving the block stops the switch (as SIGTERM does) with the edge still open.
        edge.abort("the test is over")

    data_dir = tmp_path / "switch"
    result = verify_log(data_dir / "audit.log", SealVerifier.from_file(data_dir / "audit-key.pub.pem"))
    assert result.ok, result
    records = [json.loads(line) for line in (data_dir / "audit.log").read_text().splitlines()]
    closes = [r for r in records if r["event"] == "edge.close" and r["job_id"] == JOB]
    assert len(closes) == 1, f"expected one edge.close of {JOB}, got {[r['event'] for r in records]}"
    close = closes[0]
    assert close["outcome"] == "failure" and close["details"]["ended"] == "failed", close
    assert close["details"]["reason"] == "the switch stopped", close
    # The close comes before the log's final seal: nothing was written to a closed log.
    assert records.index(close) < len(records) - 1 and records[-1]["event"] == "audit.seal", records[-3:]
    failed = [r for r in caplog.records if r.exc_info or "AuditError" in r.getMessage()]
    assert not failed, [r.getMessage() for r in failed]
