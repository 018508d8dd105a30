"""Cutting the WAN mid-job fails both stages promptly and clearly; when it returns, the switches relink."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nebula_common.launcher import LocalDeployment
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.client import ClusterSession, submit_job
from nebula_common.sdk.summary import summarize
from tests.support.accounts import make_user
from tests.support.jobs import numbers_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def own_deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    run_dir: Path = tmp_path_factory.mktemp("nebula-link-loss")
    with LocalDeployment(run_dir=run_dir, bandwidth_mbit=100.0, delay_ms=5.0) as running:
        yield running


def wait_link(session: ClusterSession, up: bool, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if session.link_status().connected == up:
            return
        time.sleep(0.1)
    raise AssertionError(f"link did not become {'up' if up else 'down'} within {timeout}s")


def test_wan_cut_fails_both_stages_then_the_link_recovers(own_deployment: LocalDeployment) -> None:
    a = make_user(own_deployment, "a", "alice")
    b = make_user(own_deployment, "b", "bob")
    job = numbers_job(steps=100_000, data__batch_size=32)
    handle = submit_job(job, {"a": a, "b": b})
    updates = handle.updates()
    for update in updates:  # let it train a few steps first
        if update.status.steps_done >= 3:
            break

    cut_at = time.monotonic()
    own_deployment.emulator.stop(timeout=5)  # SIGTERM: the proxy resets every connection it carries
    for _ in updates:
        pass
    assert time.monotonic() - cut_at < 60
    assert {s.state for s in handle.final.values()} == {trainer_pb2.STAGE_STATE_FAILED}
    messages = " | ".join(s.message for s in handle.final.values())
    assert "link" in messages.lower() or "peer" in messages.lower(), messages
    wait_link(a, up=False)

    own_deployment.emulator.start()  # same port: the dialer's backoff finds it again
    wait_link(a, up=True)
    wait_link(b, up=True)
    retry = numbers_job(steps=3, data__batch_size=32)
    summary = summarize(retry, submit_job(retry, {"a": a, "b": b}))
    assert summary.succeeded, summary.stage_messages


def test_wan_port_refuses_plaintext(own_deployment: LocalDeployment) -> None:
    wan = f"127.0.0.1:{own_deployment.cluster_state['b'].switch.info['wan_port']}"
    with grpc.insecure_channel(wan) as channel, pytest.raises(grpc.RpcError) as refused:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
