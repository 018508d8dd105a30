"""A stage's edge across hosts: sealed records on the switch's TCP edge port after mutual TLS 1.3.

Two real switches and auth services with internal TLS on, each switch serving its edge socket on a TCP
port (``NEBULA_SWITCH_EDGE_SOCKET`` = host:port, what Kubernetes runs). A job's two stages train over
it exactly as over gRPC, to the bit, with the trainer's real ``StageEdgeFds`` making each connection
(mutual TLS as the cluster's trainer, the ticket sealed) and passing it with its record state. Then
the port meets what is written to break it: a stranger without a certificate, another cluster's
trainer, a service of this cluster that is not a trainer, a trainer with a forged ticket, plaintext
records, and a flood of silent connections in front of a genuine one.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
from pathlib import Path

import grpc
import pytest
import torch

from nebula_common.pki import PkiLayout
from nebula_common.pki.service_identity import ensure_service_certificates
from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.rpc.edge_records import parse_status_record
from nebula_common.rpc.edge_tls import dial_edge
from nebula_common.rpc.framing import LINK_FRAMING_VERSION
from nebula_common.rpc.internal_tls import ClientTls, set_process_client_tls
from nebula_common.rpc.sealed_records import RecordSealing
from services.switch.edge_socket import MAX_UNTICKETED
from services.trainer.edge import EdgeSettings
from services.trainer.edge.record_io import SealedRecords
from tests.support.edges import SwitchPair, audit_records, audited, stage_records_connector, train_split

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
SETTINGS = EdgeSettings(window_bytes=1 << 20, max_outage_s=30, retransmit_s=1.0, ready_timeout_s=60)


@pytest.fixture
def pair(tls_switches: SwitchPair) -> SwitchPair:
    return tls_switches


def test_tcp_edges_train_bit_identically_to_grpc(pair: SwitchPair, tmp_path: Path) -> None:
    assert all(":" in address and "/" not in address for address in pair.edge_sockets)
    grpc_losses, grpc_params = train_split(pair, "grpc", tmp_path / "grpc", "tls-grpc", SETTINGS)
    records_losses, records_params = train_split(
        pair, "records", tmp_path / "records", "tls-records", SETTINGS
    )
    assert records_losses == grpc_losses
    for got, want in zip(records_params, grpc_params, strict=True):
        assert torch.equal(got, want)
    opens = [
        r
        for r in audit_records(pair, "edge.open")
        if r.get("job_id") == "tls-records" and r.get("outcome") == "ok"
    ]
    assert opens and all(r["details"].get("transport") == "records" for r in opens), opens


def _open(job_id: str) -> relay_pb2.EdgeOpen:
    return relay_pb2.EdgeOpen(job_id=job_id, edge="up->down", link_framing=LINK_FRAMING_VERSION)


def test_a_stage_gets_a_sealed_connection_and_no_key(pair: SwitchPair) -> None:
    """What the trainer hands its stage: the socket and that connection's record state, not its key."""
    request = stage_records_connector(pair, 0, "t-handed", {"up->down"})
    sock, sealing = request(_open("t-handed"))
    with sock:
        assert sealing is not None and sock.family in (socket.AF_INET, socket.AF_INET6)
        handed = json.dumps(sealing.handover())
        tls = pair.trainer_tls[0]
        assert tls is not None and tls.key is not None
        key_pem = tls.key.read_text()
        assert "PRIVATE KEY" in key_pem and key_pem.strip() not in handed
        sock.settimeout(30)
        ready = relay_pb2.EdgeMessage.FromString(bytes(SealedRecords(sock, sealing).read() or b""))
        assert ready.WhichOneof("body") == "ready"


def _identity(pki: PkiLayout, cluster: str, service: str) -> ClientTls:
    files = ensure_service_certificates(pki.root, cluster, (service,))[service]
    return ClientTls.for_service(files, cluster)


def _status(sock: socket.socket, sealing: RecordSealing) -> tuple[grpc.StatusCode, str]:
    sock.settimeout(30)
    reader = SealedRecords(sock, sealing)
    while True:
        raw = reader.read()
        assert raw is not None, "the switch closed without a status record"
        status = parse_status_record(raw)
        if status is not None:
            return status


def test_a_forged_ticket_from_a_genuine_trainer_is_refused(pair: SwitchPair) -> None:
    tls = pair.trainer_tls[0]
    assert tls is not None
    sock, handover = dial_edge(pair.edge_sockets[0], tls, os.urandom(32), 10)
    with sock:
        code, message = _status(sock, RecordSealing.resumed(handover))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "ticket" in message
    audited(pair, "edge.open", message)


def test_a_service_that_is_not_a_trainer_is_refused(pair: SwitchPair, pki_ab: PkiLayout) -> None:
    """The auth service's certificate is of this cluster's CA, but only a trainer carries edges."""
    sock, handover = dial_edge(pair.edge_sockets[0], _identity(pki_ab, "a", "auth"), os.urandom(32), 10)
    with sock:
        code, message = _status(sock, RecordSealing.resumed(handover))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "trainer" in message
    audited(pair, "edge.open", message)


def test_another_clusters_trainer_fails_the_handshake(pair: SwitchPair, pki_ab: PkiLayout) -> None:
    with pytest.raises(OSError):
        dial_edge(pair.edge_sockets[0], _identity(pki_ab, "b", "trainer"), os.urandom(32), 10)
    audited(pair, "edge.open", "TLS handshake failed")


def _stranger(address: str, ca: Path) -> ssl.SSLSocket:
    """A TLS client with no certificate (it trusts the cluster CA, so only its own missing one fails)."""
    host, _, port = address.rpartition(":")
    context = ssl.create_default_context(cafile=str(ca))
    context.check_hostname = False
    raw = socket.create_connection((host, int(port)), timeout=10)
    return context.wrap_socket(raw, server_hostname="switch.a.nebula.internal")


def test_a_stranger_without_a_certificate_gets_nothing(pair: SwitchPair) -> None:
    tls = pair.trainer_tls[0]
    assert tls is not None
    got = b""
    try:  # TLS 1.3: the server's refusal may arrive only after the client's side of the handshake
        with _stranger(pair.edge_sockets[0], tls.ca) as stranger:
            stranger.sendall((32).to_bytes(4, "big") + os.urandom(32))
            got = stranger.recv(1)
    except (ssl.SSLError, OSError):
        pass
    assert got == b""
    audited(pair, "edge.open", "certificate")


def test_plaintext_records_are_not_taken_for_tls(pair: SwitchPair) -> None:
    host, _, port = pair.edge_sockets[0].rpartition(":")
    answer = b""
    with socket.create_connection((host, int(port)), timeout=30) as plain:
        plain.sendall((32).to_bytes(4, "big") + os.urandom(32))
        try:
            while chunk := plain.recv(4096):
                answer += chunk
        except ConnectionResetError:
            pass
    assert len(answer) < 64, f"the switch answered plaintext with {len(answer)} bytes"  # a TLS alert at most
    audited(pair, "edge.open", "TLS handshake failed")


def test_silent_connections_cannot_keep_a_genuine_edge_out(pair: SwitchPair) -> None:
    host, _, port = pair.edge_sockets[0].rpartition(":")
    flood = [socket.create_connection((host, int(port)), timeout=30) for _ in range(MAX_UNTICKETED + 8)]
    try:
        request = stage_records_connector(pair, 0, "t-flooded", {"up->down"})
        sock, sealing = request(_open("t-flooded"))
        with sock:
            assert sealing is not None
            sock.settimeout(30)
            ready = relay_pb2.EdgeMessage.FromString(bytes(SealedRecords(sock, sealing).read() or b""))
            assert ready.WhichOneof("body") == "ready"
        pushed = 0
        for silent in flood[:8]:
            silent.settimeout(30)
            try:
                pushed += silent.recv(1) == b""
            except OSError:
                pushed += 1
        assert pushed == 8, "the oldest silent connections were not pushed out"
    finally:
        for silent in flood:
            silent.close()


def test_the_trainer_service_dials_with_its_own_identity(pair: SwitchPair) -> None:
    """A trainer service gives ``StageEdgeFds`` no identity: it dials with the process's own."""
    tls = pair.trainer_tls[0]
    assert tls is not None
    request = stage_records_connector(pair, 0, "t-process", {"up->down"}, own_identity=True)
    set_process_client_tls(tls)
    try:
        sock, sealing = request(_open("t-process"))
    finally:
        set_process_client_tls(None)
    with sock:
        assert sealing is not None
        sock.settimeout(30)
        ready = relay_pb2.EdgeMessage.FromString(bytes(SealedRecords(sock, sealing).read() or b""))
        assert ready.WhichOneof("body") == "ready"


def test_a_stopped_pair_leaves_no_trust_behind(tmp_path: Path, pki_ab: PkiLayout) -> None:
    """Its ports may next be anyone's: a plaintext test server on one must not be met with TLS."""
    from nebula_common.rpc.internal_tls import endpoint_tls, process_client_tls
    from tests.support.edges import switch_pair

    with switch_pair(tmp_path, pki_ab, edge_sockets="tcp") as pair:
        trusted = [*pair.addresses, *pair.auth_addresses]
        assert all(endpoint_tls(address) is not None for address in trusted)
    assert [address for address in trusted if endpoint_tls(address) is not None] == []
    assert process_client_tls() is None
