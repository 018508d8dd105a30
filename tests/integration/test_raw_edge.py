"""The raw edge transport (services/switch/raw_edge.py, services/trainer/edge/raw_transport.py) under
`nebula local up`: real processes, real internal TLS.

* a job's edges run on the raw edge port (both switches audit ``edge.open`` with ``transport: raw``)
  and the job ends exactly as the same job on gRPC edges (fixed seed, codec none: identical losses);
* the raw port refuses, and audits, a connection without a client certificate, a certificate of a role
  that may not open edges, a ticket used twice, a ticket presented by another certificate and an open
  with a bad token (that one never gets a ticket: the gRPC call refuses it).
"""

from __future__ import annotations

import json
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from cryptography import x509

from nebula_common.launcher import LocalDeployment
from nebula_common.pki.service_identity import ServiceTlsFiles, issue_service_certificate, service_tls_dir
from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.rpc import bearer_metadata
from nebula_common.rpc.internal_tls import ClientTls, internal_channel, server_name
from nebula_common.rpc.raw_edge import RAW_EDGE_VERSION, parse_error_record
from nebula_common.sdk.client import ClusterSession, submit_job
from nebula_common.sdk.summary import summarize
from tests.support.accounts import make_user
from tests.support.internal import service_address
from tests.support.jobs import numbers_job

pytestmark = [pytest.mark.integration, pytest.mark.rawedge, pytest.mark.timeout(900)]
T = TypeVar("T")
STEPS = 12
SPEC = {"steps": STEPS, "data__batch_size": 32, "data__micro_batches": 2}


def _wait_for(condition: Callable[[], T], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture(scope="module")
def raw_deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    run_dir: Path = tmp_path_factory.mktemp("nebula-raw-edge")
    with pytest.MonkeyPatch.context() as env:
        # The launched switches and trainers inherit this process's environment.
        env.setenv("NEBULA_SWITCH_EDGE_TRANSPORT", "raw")
        env.setenv("NEBULA_TRAINER_EDGE_TRANSPORT", "raw")
        with LocalDeployment(run_dir=run_dir, bandwidth_mbit=100.0, delay_ms=5.0) as running:
            yield running


@pytest.fixture(scope="module")
def raw_sessions(raw_deployment: LocalDeployment) -> dict[str, ClusterSession]:
    return {"a": make_user(raw_deployment, "a", "alice"), "b": make_user(raw_deployment, "b", "bob")}


def switch_audit(deployment: LocalDeployment, cluster: str, event: str) -> list[dict[str, Any]]:
    records = []
    for path in sorted((deployment.run_dir / cluster / "switch").glob("audit.log")):
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                if record.get("event") == event:
                    records.append(record)
    return records


def _fields(record: dict[str, Any]) -> dict[str, Any]:
    details = record.get("details")
    return {**record, **(details if isinstance(details, dict) else {})}


def test_a_job_on_raw_edges_ends_exactly_as_on_grpc_edges(
    raw_deployment: LocalDeployment,
    raw_sessions: dict[str, ClusterSession],
    deployment: LocalDeployment,
    sessions: dict[str, ClusterSession],
) -> None:
    raw_job = numbers_job(**SPEC)
    raw = summarize(raw_job, submit_job(raw_job, raw_sessions))
    assert raw.succeeded, raw.stage_messages
    for cluster in ("a", "b"):
        opens = [_fields(r) for r in switch_audit(raw_deployment, cluster, "edge.open")]
        on_raw = [r for r in opens if r.get("job_id") == raw_job.job_id and r.get("transport") == "raw"]
        assert on_raw, f"switch {cluster} audited no raw edge of the job: {opens}"
    grpc_job = numbers_job(**SPEC)
    reference = summarize(grpc_job, submit_job(grpc_job, sessions))
    assert reference.succeeded, reference.stage_messages
    assert len(raw.losses) == STEPS
    assert raw.losses == reference.losses


# ----------------------------------------------------------------------------- refusals on the raw port


def _trainer_tls(deployment: LocalDeployment, role: str = "trainer", cluster: str = "a") -> ClientTls:
    return ClientTls.for_service(
        ServiceTlsFiles.in_dir(service_tls_dir(deployment.pki_dir, cluster, role)), cluster
    )


def _ticket(deployment: LocalDeployment, tls: ClientTls, metadata: Any, job: str) -> relay_pb2.EdgeReady:
    """Open an edge offering the raw edge on gRPC; the switch's answer (port and ticket)."""
    address = service_address(deployment, "a", "switch")
    with internal_channel(address, service="switch", tls=tls) as channel:
        open_edge = channel.stream_stream(
            "/nebula.v1.Relay/OpenEdge",
            request_serializer=relay_pb2.EdgeMessage.SerializeToString,
            response_deserializer=relay_pb2.EdgeMessage.FromString,
        )
        opened = relay_pb2.EdgeOpen(job_id=job, edge="e", raw_edge=RAW_EDGE_VERSION, link_framing=1)
        call = open_edge(iter([relay_pb2.EdgeMessage(open=opened)]), metadata=metadata, timeout=30)
        first = next(iter(call))
    assert first.WhichOneof("body") == "ready" and first.ready.raw_edge_port, first
    return first.ready


def _raw_exchange(port: int, tls: ClientTls | None, ca: Path, record: bytes) -> bytes:
    """Connect to the raw edge port (``tls``: the client certificate, or none), send one record, read one."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cafile=str(ca))
    if tls is not None:
        context.load_cert_chain(str(tls.cert), str(tls.key))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=30) as raw_sock,
        context.wrap_socket(raw_sock, server_hostname=server_name("switch", "a")) as sock,
    ):
        sock.sendall(len(record).to_bytes(4, "big") + record)
        head = b""
        while len(head) < 4:
            part = sock.recv(4 - len(head))
            if not part:
                return b""
            head += part
        size = int.from_bytes(head, "big")
        body = b""
        while len(body) < size:
            part = sock.recv(size - len(body))
            if not part:
                break
            body += part
        return body


def _refused_code(answer: bytes) -> str:
    refused = parse_error_record(answer)
    assert refused is not None, f"expected an error record, got {answer[:80]!r}"
    return refused[0]


def _audited(
    deployment: LocalDeployment, event: str, match: Callable[[dict[str, Any]], bool], what: str
) -> None:
    _wait_for(lambda: [r for r in map(_fields, switch_audit(deployment, "a", event)) if match(r)], 15, what)


def test_the_raw_port_refuses_and_audits_wrong_certificates_tickets_and_tokens(
    raw_deployment: LocalDeployment, raw_sessions: dict[str, ClusterSession], tmp_path: Path
) -> None:
    metadata = raw_sessions["a"].metadata
    trainer = _trainer_tls(raw_deployment)
    ready = _ticket(raw_deployment, trainer, metadata, "raw-refusals")
    port, ca = ready.raw_edge_port, trainer.ca

    # No client certificate: the TLS handshake is refused (the ticket is never read).
    with pytest.raises((ssl.SSLError, ConnectionError)):
        answer = _raw_exchange(port, None, ca, ready.raw_edge_ticket)
        assert not answer, answer  # an ended connection is a refusal too
        raise ConnectionError("the connection ended")
    _audited(
        raw_deployment,
        "auth.refused",
        lambda r: r.get("transport") == "raw" and "TLS handshake" in str(r.get("reason")),
        "the refused handshake's audit record",
    )

    # A certificate of a role that may not open edges (the data service's).
    answer = _raw_exchange(port, _trainer_tls(raw_deployment, "data"), ca, ready.raw_edge_ticket)
    assert _refused_code(answer) == "PERMISSION_DENIED"
    _audited(
        raw_deployment,
        "auth.refused",
        lambda r: r.get("transport") == "raw" and "/data" in str(r.get("peer_identity")),
        "the wrong role's audit record",
    )

    # The ticket was not consumed by those: its holder is let in, once.
    answer = _raw_exchange(port, trainer, ca, ready.raw_edge_ticket)
    message = relay_pb2.EdgeMessage.FromString(answer)
    assert message.WhichOneof("body") == "ready", message
    answer = _raw_exchange(port, trainer, ca, ready.raw_edge_ticket)
    assert _refused_code(answer) == "UNAUTHENTICATED"
    _audited(
        raw_deployment,
        "edge.open",
        lambda r: r.get("transport") == "raw" and "already used" in str(r.get("reason")),
        "the reused ticket's audit record",
    )

    # A ticket presented by another certificate (the same role, renewed: another serial).
    old = tmp_path / "old-trainer"
    old.mkdir()
    for name in ("ca", "cert", "key"):
        source = getattr(trainer, name)
        (old / source.name).write_bytes(source.read_bytes())
    old_tls = ClientTls("a", old / trainer.ca.name, old / trainer.cert.name, old / trainer.key.name)
    foreign = _ticket(raw_deployment, old_tls, metadata, "raw-foreign")
    issue_service_certificate(raw_deployment.pki_dir, "a", "trainer", by="test")
    renewed = _trainer_tls(raw_deployment)
    assert x509.load_pem_x509_certificate(renewed.cert.read_bytes()).serial_number != (
        x509.load_pem_x509_certificate(old_tls.cert.read_bytes()).serial_number
    )
    answer = _raw_exchange(port, renewed, ca, foreign.raw_edge_ticket)
    assert _refused_code(answer) == "UNAUTHENTICATED"
    _audited(
        raw_deployment,
        "edge.open",
        lambda r: r.get("transport") == "raw" and "presented by" in str(r.get("reason")),
        "the foreign ticket's audit record",
    )

    # A bad token never gets a ticket: the gRPC call is refused as before.
    with pytest.raises(grpc.RpcError) as refused:
        _ticket(raw_deployment, renewed, bearer_metadata("not-a-token"), "raw-bad-token")
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
