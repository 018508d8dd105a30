"""Every RPC of every internal port refuses a missing, garbage, expired or other-cluster token.

Generated, not listed: each port is asked by server reflection which services it
serves, and every method of every such service is called, so a new RPC or a new
service on a port is covered the day it is added. Only ``auth.policy``'s public
methods and gRPC health/reflection may answer without a token.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import MethodDescriptor
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from nebula_common.auth.policy import PUBLIC_METHODS, is_public
from nebula_common.auth.roles import ROLE_MATRIX
from nebula_common.launcher import LocalDeployment
from nebula_common.metrics import read_metrics
from nebula_common.proto.nebula.v1 import (  # noqa: F401  (importing registers the descriptors)
    audit_pb2,
    audit_pb2_grpc,
    auth_pb2,
    codec_pb2,
    data_pb2,
    relay_pb2,
    trainer_pb2,
    trainer_pb2_grpc,
)
from nebula_common.rpc import bearer_metadata
from nebula_common.sdk.auth_client import AuthClient
from services.auth.tokens import TokenIssuer
from tests.support.internal import service_channel, user_channel

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _ports(deployment: LocalDeployment) -> dict[str, str]:
    state = deployment.cluster_state["a"]
    return {
        "auth": deployment.address(state.auth),
        "codec": deployment.address(state.codec),
        "data": deployment.address(state.data),
        "trainer": deployment.address(state.trainer),
        "switch": deployment.endpoints("a").switch,
    }


def _channel_for(deployment: LocalDeployment, port: str, address: str, path: str) -> grpc.Channel:
    """A user's channel for user-facing methods; for service-only ones, one of a role allowed to call it.

    So every call gets past the role check (``nebula_common/auth/roles.py``) and the token check is
    what answers; ``tests/unit/test_internal_tls.py`` covers the role check itself.
    """
    access = ROLE_MATRIX[path]
    if access.users:
        return user_channel(address, port)
    return service_channel(deployment, "a", port, as_role=sorted(access.roles)[0])


def _served_services(address: str, port: str) -> list[str]:
    with user_channel(address, port) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (reply,) = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
    return [s.name for s in reply.list_services_response.service if s.name.startswith("nebula.")]


def _call(channel: grpc.Channel, method: MethodDescriptor, metadata: tuple[tuple[str, str], ...]) -> None:
    """Call ``method`` with an empty request; raises the RpcError the server answers with."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    request = message_factory.GetMessageClass(method.input_type)()
    kwargs = {"request_serializer": type(request).SerializeToString, "response_deserializer": bytes}
    if method.client_streaming and method.server_streaming:
        list(channel.stream_stream(path, **kwargs)(iter([request]), metadata=metadata, timeout=10))
    elif method.client_streaming:
        channel.stream_unary(path, **kwargs)(iter([request]), metadata=metadata, timeout=10)
    elif method.server_streaming:
        list(channel.unary_stream(path, **kwargs)(request, metadata=metadata, timeout=10))
    else:
        channel.unary_unary(path, **kwargs)(request, metadata=metadata, timeout=10)


@pytest.fixture(scope="module")
def bad_credentials(deployment: LocalDeployment) -> dict[str, tuple[tuple[str, str], ...]]:
    """Call metadata that must never pass: none, garbage, an expired token of a, a valid token of b."""
    expired = TokenIssuer(deployment.run_dir / "a" / "auth", "a", ttl_seconds=60).issue(
        "admin", "admin", now=time.time() - 3600
    )
    with AuthClient(deployment.endpoints("b").auth) as client:
        other = client.login("admin", deployment.cluster_state["b"].admin_password).token
    return {
        "missing": (),
        "garbage": bearer_metadata("not.a.token"),
        "expired": bearer_metadata(expired.token),
        "other-cluster": bearer_metadata(other),
    }


def _methods(deployment: LocalDeployment) -> Iterator[tuple[str, str, MethodDescriptor]]:
    pool = descriptor_pool.Default()
    for port, address in _ports(deployment).items():
        services = _served_services(address, port)
        assert services, f"{port} serves no nebula.* service"
        for name in services:
            for method in pool.FindServiceByName(name).methods:
                yield port, address, method


def test_every_rpc_of_every_internal_port_refuses_bad_tokens(
    deployment: LocalDeployment, bad_credentials: dict[str, tuple[tuple[str, str], ...]]
) -> None:
    checked: set[str] = set()
    answered_publicly: set[str] = set()
    for port, address, method in _methods(deployment):
        path = f"/{method.containing_service.full_name}/{method.name}"
        with _channel_for(deployment, port, address, path) as channel:
            for kind, metadata in bad_credentials.items():
                try:
                    _call(channel, method, metadata)
                    code, details = grpc.StatusCode.OK, ""
                except grpc.RpcError as exc:
                    code, details = exc.code(), exc.details() or ""
                if is_public(path):
                    # Reached the servicer (Login may still refuse the empty credentials it was given).
                    assert "bearer token" not in details and not details.startswith("invalid token"), (
                        f"public {path} on {port} was refused for its {kind} token: {details}"
                    )
                    answered_publicly.add(path)
                else:
                    assert code == grpc.StatusCode.UNAUTHENTICATED, (
                        f"{path} on {port} answered {code.name} to a {kind} token"
                    )
        checked.add(f"{port}{path}")
    # The sweep really covered every port, including the codec service and the audit APIs.
    assert {"codec/nebula.v1.Codec/Advise", "switch/nebula.v1.Relay/OpenEdge"} <= checked
    assert {p for p in checked if p.endswith("/nebula.v1.AuditLog/Query")} == {
        f"{port}/nebula.v1.AuditLog/Query" for port in ("auth", "data", "trainer", "switch")
    }
    assert answered_publicly == set(PUBLIC_METHODS)


def test_a_valid_token_gets_past_the_check_on_every_port(deployment: LocalDeployment) -> None:
    """The refusals above are about the token, not the port: the same calls with a good token pass."""
    with AuthClient(deployment.endpoints("a").auth) as client:
        token = client.login("admin", deployment.cluster_state["a"].admin_password).token
    pool = descriptor_pool.Default()
    read_only = {
        "auth": "nebula.v1.Auth.ListAccounts",
        "codec": "nebula.v1.Codec.ListCodecs",
        "data": "nebula.v1.Data.ListDatasets",
        "trainer": "nebula.v1.AuditLog.GetAuditKey",
        "switch": "nebula.v1.Relay.GetLinkStatus",
    }
    for port, address in _ports(deployment).items():
        method = pool.FindMethodByName(read_only[port])
        with user_channel(address, port) as channel:
            _call(channel, method, bearer_metadata(token))


def test_refusals_are_audited_and_counted(deployment: LocalDeployment) -> None:
    """Each refusal leaves an ``auth.refused`` record (method, reason, peer) and a metric sample."""
    address = _ports(deployment)["trainer"]
    since = time.time() - 1
    with user_channel(address, "trainer") as channel:
        with pytest.raises(grpc.RpcError) as refused:
            trainer_pb2_grpc.TrainerStub(channel).ListCheckpoints(
                trainer_pb2.ListCheckpointsRequest(job_id="x"),
                metadata=bearer_metadata("garbage"),
                timeout=10,
            )
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with AuthClient(deployment.endpoints("a").auth) as client:
            admin = client.login("admin", deployment.cluster_state["a"].admin_password).token
        reply = audit_pb2_grpc.AuditLogStub(channel).Query(
            audit_pb2.AuditQuery(event="auth.refused", since_unix=int(since)),
            metadata=bearer_metadata(admin),
            timeout=10,
        )
    details = [json.loads(record)["details"] for record in reply.records_json]
    assert any(
        d["method"] == "/nebula.v1.Trainer/ListCheckpoints"
        and d["reason"].startswith("invalid token")
        and d["peer"]
        for d in details
    ), details
    metrics_url = deployment.endpoints("a").metrics["trainer-a"]
    body = read_metrics(metrics_url, timeout=10)
    assert 'nebula_rpc_refusals_total{method="ListCheckpoints",reason="bad-token",service="trainer"}' in body
