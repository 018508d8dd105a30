"""Every metric the Grafana dashboard queries is exported by a live deployment, and the JSON is fresh."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nebula_common.launcher import LocalDeployment
from nebula_common.proto.nebula.v1 import relay_pb2, relay_pb2_grpc
from nebula_common.sdk.client import ClusterSession, submit_job
from nebula_common.sdk.summary import summarize
from tests.support.jobs import numbers_job

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docker" / "monitoring" / "nebula-dashboard.json"
pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def exported_sample_names(deployment: LocalDeployment) -> set[str]:
    names: set[str] = set()
    for cluster in deployment.clusters:
        for url in deployment.endpoints(cluster).metrics.values():
            with urllib.request.urlopen(url, timeout=5) as response:
                for family in text_string_to_metric_families(response.read().decode()):
                    names.update(sample.name for sample in family.samples)
    return names


def test_dashboard_json_is_generated_from_the_panel_list() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "build_dashboard.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_every_dashboard_metric_is_exported(
    deployment: LocalDeployment, sessions: dict[str, ClusterSession]
) -> None:
    job = numbers_job(steps=2, data__batch_size=16)
    assert summarize(job, submit_job(job, sessions)).succeeded
    # Provoke a refusal: labelled counters only appear once they have counted something.
    with grpc.insecure_channel(deployment.endpoints("a").switch) as channel, pytest.raises(grpc.RpcError):
        relay_pb2_grpc.RelayStub(channel).GetLinkStatus(relay_pb2.GetLinkStatusRequest(), timeout=5)
    exported = exported_sample_names(deployment)
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\bnebula_[a-z0-9_]+", target["expr"])
    }
    assert len(queried) >= 10
    missing = sorted(queried - exported)
    assert not missing, f"dashboard queries metrics no service exports: {missing}"
