"""What the deployment refuses: no mTLS on the WAN, no token, a foreign cluster's token, another account."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nebula_common.launcher import LocalDeployment
from nebula_common.pki import Identity, channel_credentials, channel_options, create_ca, issue_certificate
from nebula_common.proto.nebula.v1 import relay_pb2, relay_pb2_grpc, trainer_pb2
from nebula_common.rpc import bearer_metadata
from nebula_common.sdk.client import ClusterSession
from tests.support.internal import service_channel, user_channel
from tests.support.jobs import numbers_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def wan_address(deployment: LocalDeployment, cluster: str) -> str:
    return f"127.0.0.1:{deployment.cluster_state[cluster].switch.info['wan_port']}"


def health_over(address: str, credentials: grpc.ChannelCredentials, options: list) -> grpc.StatusCode | None:
    with grpc.secure_channel(address, credentials, options=options) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
            return None
        except grpc.RpcError as exc:
            return exc.code()


def test_wan_port_refuses_a_client_without_certificate(deployment: LocalDeployment) -> None:
    trust_b = deployment.pki_dir / "a" / "trust-bundle.pem"  # a's bundle holds b's CA: the server verifies
    credentials = grpc.ssl_channel_credentials(root_certificates=trust_b.read_bytes())
    options = channel_options(Identity("b", "switch"))
    assert health_over(wan_address(deployment, "b"), credentials, options) == grpc.StatusCode.UNAVAILABLE


def test_wan_port_refuses_a_certificate_from_an_unknown_ca(deployment: LocalDeployment) -> None:
    rogue_ca, rogue_key = create_ca("a")  # same cluster name, different (untrusted) CA
    cert, key = issue_certificate(rogue_ca, rogue_key, Identity("a", "switch"))
    from cryptography.hazmat.primitives import serialization

    credentials = grpc.ssl_channel_credentials(
        root_certificates=(deployment.pki_dir / "a" / "trust-bundle.pem").read_bytes(),
        private_key=key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
        certificate_chain=cert.public_bytes(serialization.Encoding.PEM),
    )
    options = channel_options(Identity("b", "switch"))
    assert health_over(wan_address(deployment, "b"), credentials, options) == grpc.StatusCode.UNAVAILABLE


def test_wan_port_serves_only_the_switch_link(deployment: LocalDeployment) -> None:
    """Even the genuine peer switch cannot reach the internal Relay API through the WAN port."""
    layout_a = deployment.pki_dir / "a"
    from nebula_common.pki import load_layout

    paths = load_layout(deployment.pki_dir, ["a", "b"]).cluster("a")
    assert paths.dir == layout_a
    with grpc.secure_channel(
        wan_address(deployment, "b"),
        channel_credentials(paths),
        options=channel_options(Identity("b", "switch")),
    ) as channel:
        assert (
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
        )
        with pytest.raises(grpc.RpcError) as refused:
            relay_pb2_grpc.RelayStub(channel).GetLinkStatus(relay_pb2.GetLinkStatusRequest(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def open_edge_code(deployment: LocalDeployment, cluster: str, metadata: tuple) -> grpc.StatusCode:
    # OpenEdge is service-only: called as the cluster's trainer, so the token check is what answers.
    with service_channel(deployment, cluster, "switch", as_role="trainer") as channel:
        stub = relay_pb2_grpc.RelayStub(channel)
        call = stub.OpenEdge(
            iter([relay_pb2.EdgeMessage(open=relay_pb2.EdgeOpen(job_id="j", edge="e"))]),
            metadata=metadata,
            timeout=5,
        )
        with pytest.raises(grpc.RpcError) as refused:
            list(call)
    return refused.value.code()


def test_switch_refuses_edges_without_a_valid_token_of_its_cluster(
    deployment: LocalDeployment, sessions: dict[str, ClusterSession]
) -> None:
    assert open_edge_code(deployment, "a", ()) == grpc.StatusCode.UNAUTHENTICATED
    assert open_edge_code(deployment, "a", bearer_metadata("not-a-jwt")) == grpc.StatusCode.UNAUTHENTICATED
    # A perfectly valid token, but issued by cluster b's auth service: worthless in cluster a.
    assert open_edge_code(deployment, "a", sessions["b"].metadata) == grpc.StatusCode.UNAUTHENTICATED


def test_link_status_needs_a_token_of_the_switchs_cluster(
    deployment: LocalDeployment, sessions: dict[str, ClusterSession]
) -> None:
    with user_channel(deployment.endpoints("a").switch, "switch") as channel:
        stub = relay_pb2_grpc.RelayStub(channel)
        for metadata in ((), sessions["b"].metadata):
            with pytest.raises(grpc.RpcError) as refused:
                stub.GetLinkStatus(relay_pb2.GetLinkStatusRequest(), metadata=metadata, timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.GetLinkStatus(relay_pb2.GetLinkStatusRequest(), metadata=sessions["a"].metadata).connected


def test_trainer_runs_nothing_without_a_token_of_its_own_cluster(
    deployment: LocalDeployment, sessions: dict[str, ClusterSession]
) -> None:
    spec = numbers_job("foreign-token", steps=1).stage_spec("encoder")
    request = trainer_pb2.AssignStageRequest(spec=spec)
    for metadata in ((), bearer_metadata("garbage"), sessions["b"].metadata):
        with pytest.raises(grpc.RpcError) as refused:
            sessions["a"].trainer.AssignStage(request, metadata=metadata, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_invalid_stage_spec_is_refused_with_the_field_named(sessions: dict[str, ClusterSession]) -> None:
    spec = numbers_job("bad-spec", steps=1).stage_spec("encoder")
    spec.codec_forward = "zip9"
    spec.program.micro_batches = 3
    with pytest.raises(grpc.RpcError) as refused:
        sessions["a"].trainer.AssignStage(
            trainer_pb2.AssignStageRequest(spec=spec), metadata=sessions["a"].metadata, timeout=10
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "codec_forward" in refused.value.details()
    assert "micro_batches 3" in refused.value.details()


def test_one_account_cannot_watch_or_cancel_another_accounts_stage(
    deployment: LocalDeployment,
    new_user: Callable[[str, str], ClusterSession],
    sessions: dict[str, ClusterSession],
) -> None:
    job = numbers_job("owned-by-alice", steps=2, data__batch_size=16)
    sessions["a"].assign(job.stage_spec("encoder"))
    mallory = new_user("a", "mallory")
    for call in (
        lambda: list(
            mallory.trainer.WatchStage(
                trainer_pb2.WatchStageRequest(job_id=job.job_id), metadata=mallory.metadata, timeout=5
            )
        ),
        lambda: mallory.trainer.CancelStage(
            trainer_pb2.CancelStageRequest(job_id=job.job_id), metadata=mallory.metadata, timeout=5
        ),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    sessions["a"].cancel(job.job_id)  # the owner can
    final = list(sessions["a"].watch(job.job_id))[-1]
    assert final.state == trainer_pb2.STAGE_STATE_CANCELLED
    # ...and the trainer audits how the stage ended (written once the stage thread is done).
    log = deployment.run_dir / "a" / "trainer" / "audit.log"
    deadline = time.monotonic() + 30
    while True:
        stops = [
            record
            for record in map(json.loads, log.read_text().splitlines())
            if record["event"] == "stage.stop" and record.get("job_id") == job.job_id
        ]
        if stops or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert [(r["outcome"], r["details"]["state"]) for r in stops] == [("failure", "STAGE_STATE_CANCELLED")]
