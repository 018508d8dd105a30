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
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.client import ClusterSession, submit_job
from nebula_common.sdk.summary import summarize
from services.trainer.edge import EdgeSettings
from tests.support.edges import SwitchPair, finish, stage_runner
from tests.support.jobs import numbers_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
SETTINGS = EdgeSettings(window_bytes=1 << 20, max_outage_s=30, retransmit_s=1.0, ready_timeout_s=60)


def _train(switches: SwitchPair, carrier: str, work: Path) -> tuple[dict[int, float], list[torch.Tensor]]:
    """Both stages of one job on ``carrier``: the downstream's losses, then every parameter of both."""
    job = numbers_job(f"carrier-{carrier}", steps=6)
    runs = [stage_runner(job, index, work, switches, SETTINGS, carrier=carrier) for index in (0, 1)]
    for run in runs:
        run.runner.start()
    for run in runs:
        finish(run, 240)
        assert run.final.state == trainer_pb2.STAGE_STATE_SUCCEEDED, run.final.message
    losses = runs[1].losses()
    assert len(losses) == 6
    return losses, [p for run in runs for p in run.parameters()]


def test_the_records_carrier_trains_bit_identically_to_grpc(switches: SwitchPair, tmp_path: Path) -> None:
    grpc_losses, grpc_params = _train(switches, "grpc", tmp_path / "grpc")
    records_losses, records_params = _train(switches, "records", tmp_path / "records")
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
