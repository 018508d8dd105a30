"""Split training over the switches' edge sockets: the same losses, to the bit, as over gRPC.

Two real switches with their edge sockets; both stages of the built-in ``numbers`` job run as real
``ProgramRunner``s, once with their edges on OpenEdge streams and once as records on connections a
trainer's ``StageEdgeFds`` tickets, connects and passes them (what a stage process gets under
``nebula local up``). Then, on the package's ``local up`` deployment, a job's edges are checked to run
as records (the switches' ``edge.open`` records).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nebula_common.launcher import LocalDeployment
from nebula_common.sdk.client import ClusterSession, submit_job
from nebula_common.sdk.summary import summarize
from services.trainer.edge import EdgeSettings
from tests.support.edges import SwitchPair, train_split
from tests.support.jobs import numbers_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
SETTINGS = EdgeSettings(window_bytes=1 << 20, max_outage_s=30, retransmit_s=1.0, ready_timeout_s=60)


def test_the_records_carrier_trains_bit_identically_to_grpc(switches: SwitchPair, tmp_path: Path) -> None:
    grpc_losses, grpc_params = train_split(switches, "grpc", tmp_path / "grpc", "carrier-grpc", SETTINGS)
    records_losses, records_params = train_split(
        switches, "records", tmp_path / "records", "carrier-records", SETTINGS
    )
    assert records_losses == grpc_losses
    assert len(records_params) == len(grpc_params)
    for got, want in zip(records_params, grpc_params, strict=True):
        assert torch.equal(got, want)


def _edge_opens(deployment: LocalDeployment, cluster: str, job_id: str) -> list[dict[str, object]]:
    path = deployment.run_dir / cluster / "switch" / "audit.log"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [
        r
        for r in records
        if r["event"] == "edge.open" and r.get("job_id") == job_id and r.get("outcome") == "ok"
    ]


def test_local_up_gives_every_stage_records_edges(
    deployment: LocalDeployment, sessions: dict[str, ClusterSession]
) -> None:
    job = numbers_job(steps=4)
    summary = summarize(job, submit_job(job, sessions))
    assert summary.succeeded, summary.stage_messages
    assert len(summary.losses) == 4
    for cluster in ("a", "b"):
        opens = _edge_opens(deployment, cluster, job.job_id)
        assert opens, f"no edge of {job.job_id} opened on switch {cluster}"
        assert all(r["details"].get("transport") == "records" for r in opens), opens
