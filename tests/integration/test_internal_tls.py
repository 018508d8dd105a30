"""Internal TLS on a fresh `nebula local up`: every internal port is TLS, roles are enforced, and
service certificates are renewed during a running job without a failed call or a lost step."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nebula_common.launcher import LocalDeployment
from nebula_common.metrics import read_metrics
from nebula_common.pki.service_identity import (
    SERVICE_ROLES,
    ServiceTlsFiles,
    issue_service_certificate,
    service_tls_dir,
)
from nebula_common.proto.nebula.v1 import audit_pb2, audit_pb2_grpc, relay_pb2, relay_pb2_grpc, trainer_pb2
from nebula_common.rpc import bearer_metadata
from nebula_common.rpc.internal_tls import ClientTls, internal_channel
from nebula_common.sdk.auth_client import AuthClient
from nebula_common.sdk.client import ClusterSession, submit_job
from nebula_common.sdk.summary import summarize
from tests.support.internal import service_address, service_channel, user_channel
from tests.support.jobs import numbers_job
from tests.support.tls_probe import served_certificate
from tests.support.waiting import wait_for

_wait_for = functools.partial(wait_for, interval=0.2)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
T = TypeVar("T")


def _ports(deployment: LocalDeployment) -> dict[str, tuple[str, str]]:
    """name -> (address, service) of every internal port of both clusters (20: two per service)."""
    ports = {}
    for cluster in deployment.clusters:
        for service in SERVICE_ROLES:
            info = deployment.process(f"{service}-{cluster}").info
            user_key = "internal_port" if service == "switch" else "grpc_port"
            ports[f"{service}-{cluster}/client"] = (f"127.0.0.1:{info[user_key]}", service)
            ports[f"{service}-{cluster}/service"] = (f"127.0.0.1:{info['service_port']}", service)
    return ports


def test_plaintext_fails_on_every_internal_port(deployment: LocalDeployment) -> None:
    ports = _ports(deployment)
    assert len(ports) == 20
    for name, (address, _) in ports.items():
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as refused:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, name


def test_service_ports_refuse_tls_without_a_client_certificate(deployment: LocalDeployment) -> None:
    for name, (address, service) in _ports(deployment).items():
        with user_channel(address, service) as channel:
            call = health_pb2_grpc.HealthStub(channel).Check
            if name.endswith("/client"):
                assert call(health_pb2.HealthCheckRequest(), timeout=10).status == 1, name
            else:
                with pytest.raises(grpc.RpcError) as refused:
                    call(health_pb2.HealthCheckRequest(), timeout=5)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, name


def test_a_role_that_may_not_call_is_denied_and_audited(
    deployment: LocalDeployment, sessions: dict[str, ClusterSession]
) -> None:
    """The codec's certificate is valid in cluster a, but only a trainer may open an edge."""
    opening = relay_pb2.EdgeMessage(open=relay_pb2.EdgeOpen(job_id="not-a-codec-job", edge="e"))
    since = time.time() - 1
    with service_channel(deployment, "a", "switch", as_role="codec") as channel:
        stream = relay_pb2_grpc.RelayStub(channel).OpenEdge(
            iter([opening]), metadata=sessions["a"].metadata, timeout=10
        )
        with pytest.raises(grpc.RpcError) as refused:
            next(iter(stream))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "role 'codec' may not call /nebula.v1.Relay/OpenEdge" in (refused.value.details() or "")
    admin = deployment.cluster_state["a"]
    with AuthClient(deployment.endpoints("a").auth) as auth:
        token = auth.login("admin", admin.admin_password).token
    with user_channel(deployment.endpoints("a").switch, "switch") as channel:
        reply = audit_pb2_grpc.AuditLogStub(channel).Query(
            audit_pb2.AuditQuery(event="auth.refused", since_unix=since),
            metadata=bearer_metadata(token),
            timeout=10,
        )
    records = [json.loads(r) for r in reply.records_json]
    assert any(
        r["details"].get("peer_identity") == "spiffe://nebula/cluster/a/codec"
        and r["details"]["method"] == "/nebula.v1.Relay/OpenEdge"
        for r in records
    ), records


def _scrape(url: str, name: str, labels: str) -> float:
    for line in read_metrics(url, timeout=10).splitlines():
        if line.startswith(f"{name}{{{labels}}}"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.faults  # renews every certificate under a running job (`make test-faults`)
def test_renewing_every_service_certificate_during_a_job_loses_nothing(
    deployment: LocalDeployment, sessions: dict[str, ClusterSession]
) -> None:
    steps = 30
    job = numbers_job(steps=steps, data__micro_batches=2, data__batch_size=32)
    renewed: dict[tuple[str, str], int] = {}

    def renew_mid_job(status: trainer_pb2.StageStatus) -> None:
        if renewed or status.steps_done < 5:
            return
        for cluster in deployment.clusters:
            for service in SERVICE_ROLES:
                files = issue_service_certificate(deployment.pki_dir, cluster, service, by="test")
                cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
                renewed[(cluster, service)] = cert.serial_number

    summary = summarize(job, submit_job(job, sessions), on_step=renew_mid_job)
    assert summary.succeeded, summary.stage_messages
    assert renewed, f"the job ended before step 5: {summary.losses}"
    assert len(summary.losses) == steps  # no step lost
    for (cluster, service), serial in renewed.items():
        # Every service took its new certificate into use (counted), and new handshakes get it.
        metrics = deployment.endpoints(cluster).metrics[f"{service}-{cluster}"]
        _wait_for(
            lambda metrics=metrics, service=service: (
                _scrape(metrics, "nebula_internal_certificate_renewals_total", f'service="{service}"') >= 1
            ),
            30,
            f"{service}-{cluster} to reload its certificate",
        )
        # A fresh handshake on the client port (the service port would want a client certificate).
        info = deployment.process(f"{service}-{cluster}").info
        port = info["internal_port" if service == "switch" else "grpc_port"]
        leaf = served_certificate(
            f"127.0.0.1:{port}", deployment.ca_cert(cluster), f"{service}.{cluster}.nebula.internal"
        )
        assert leaf.serial_number == serial, f"{service}-{cluster} still serves its old certificate"
    # Services keep calling each other with their renewed identities.
    files = ServiceTlsFiles.in_dir(service_tls_dir(deployment.pki_dir, "a", "trainer"))
    with internal_channel(
        service_address(deployment, "a", "switch"), service="switch", tls=ClientTls.for_service(files, "a")
    ) as channel:
        status = relay_pb2_grpc.RelayStub(channel).GetLinkStatus(
            relay_pb2.GetLinkStatusRequest(), metadata=sessions["a"].metadata, timeout=10
        )
    assert status.connected


def test_no_service_is_given_a_ca_key(deployment: LocalDeployment) -> None:
    """The launcher renews every certificate itself: no service's environment names a CA key."""
    ca_keys = {str(deployment.pki_dir / cluster / "ca.key") for cluster in deployment.clusters}
    checked = []
    for process in deployment.all_processes():
        pid = process.pid
        assert pid is not None, process.name
        environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
        pairs = dict(item.split("=", 1) for item in environ if "=" in item)
        named = {k for k in pairs if k.endswith("CA_KEY")}
        pointing = {k for k, v in pairs.items() if v in ca_keys or v.endswith("/ca.key")}
        assert not named and not pointing, (process.name, named | pointing)
        checked.append(process.name)
    assert {f"{s}-{c}" for s in SERVICE_ROLES for c in deployment.clusters} <= set(checked)
