"""The switch's edge socket: tickets from Relay/IssueEdgeTicket, every way a local client can abuse it,
and a trainer's answers to its stage's requests for edge connections (``StageEdgeFds``).

Real switches (clusters a and b, linked), real Unix sockets and real gRPC; the hostile client writes
records by hand. Every refusal must reach the client as a status record naming why, be audited, and
leave the switch serving everyone else.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from nebula_common.auth.roles import refusal
from nebula_common.pki import PkiLayout
from nebula_common.proto.nebula.v1 import auth_pb2, auth_pb2_grpc, relay_pb2, relay_pb2_grpc
from nebula_common.rpc import bearer_metadata
from nebula_common.rpc.edge_records import MAX_EDGE_RECORD_BYTES, parse_status_record
from nebula_common.rpc.framing import LINK_FRAMING_VERSION, encode_chunk
from nebula_common.rpc.internal_tls import internal_channel
from nebula_common.rpc.unix_paths import SUN_PATH_LIMIT, connect_unix
from services.switch.edge_socket import MAX_UNTICKETED, EdgeSocket
from services.trainer.edge.socket_request import EdgeSocketRefused, EdgeSocketRequester
from services.trainer.stage_edge_fds import StageEdgeFds
from tests.support.edges import SwitchPair, audited, stage_proxy, stage_records_connector, switch_pair
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(120)
ISSUE = "/nebula.v1.Relay/IssueEdgeTicket"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, pki_ab: PkiLayout) -> Iterator[SwitchPair]:
    # Deeper than a Unix socket address holds: every test here also proves the socket is bound and
    # reached at such a path (``nebula_common/rpc/unix_paths.py``), as a long run directory makes it.
    work = tmp_path_factory.mktemp("edge-socket") / ("a-run-directory-deep-in-a-home-" * 3)
    work.mkdir()
    with switch_pair(work, pki_ab, edge_sockets=True) as switches:
        assert all(len(os.fsencode(path)) > SUN_PATH_LIMIT for path in switches.edge_sockets)
        yield switches


def _edge_socket(pair: SwitchPair) -> EdgeSocket:
    served = pair.threads[0].running.edge_socket
    assert served is not None
    return served


def _open(job_id: str, edge: str = "up->down", **fields: Any) -> relay_pb2.EdgeOpen:
    return relay_pb2.EdgeOpen(job_id=job_id, edge=edge, **{"link_framing": LINK_FRAMING_VERSION, **fields})


def _ticket(pair: SwitchPair, open_: relay_pb2.EdgeOpen, token: str | None = None) -> bytes:
    with internal_channel(pair.addresses[0], service="switch") as channel:
        reply = relay_pb2_grpc.RelayStub(channel).IssueEdgeTicket(
            relay_pb2.EdgeTicketRequest(open=open_),
            metadata=bearer_metadata(token or pair.tokens[0]),
            timeout=10,
        )
    assert reply.expires_in_ms > 0
    return bytes(reply.ticket)


def _issue_error(pair: SwitchPair, open_: relay_pb2.EdgeOpen, token: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        _ticket(pair, open_, token)
    return raised.value


class _Client:
    """A hand-written records client on the edge socket."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        connect_unix(self.sock, path)

    def send(self, data: bytes) -> None:
        self.sock.sendall(len(data).to_bytes(4, "big") + data)

    def _exactly(self, n: int) -> bytes:
        got = b""
        while len(got) < n:
            part = self.sock.recv(n - len(got))
            if not part:
                raise EOFError("the switch closed the connection")
            got += part
        return got

    def receive(self) -> bytes:
        return self._exactly(int.from_bytes(self._exactly(4), "big"))

    def status(self) -> tuple[grpc.StatusCode, str]:
        """The status record that ends this connection (any items before it are skipped)."""
        while True:
            status = parse_status_record(self.receive())
            if status is not None:
                return status

    def closed(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except OSError:
            return True

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def client(pair: SwitchPair) -> Iterator[_Client]:
    made = _Client(pair.edge_sockets[0])
    yield made
    made.close()


def _still_serves(pair: SwitchPair, job_id: str) -> None:
    """A genuine client gets its EdgeReady on a new connection, then closes its edge."""
    genuine = _Client(pair.edge_sockets[0])
    try:
        genuine.send(_ticket(pair, _open(job_id)))
        ready = relay_pb2.EdgeMessage.FromString(genuine.receive())
        assert ready.WhichOneof("body") == "ready", ready
    finally:
        genuine.close()


def test_the_ticket_rpc_is_a_trainers_and_a_jobs_as_open_edge_is() -> None:
    assert refusal(ISSUE, "trainer") is None
    for role in ("data", "codec", "switch", "auth", None):
        assert refusal(ISSUE, role) is not None


def test_ticket_refusals_name_why_and_areaudited(pair: SwitchPair) -> None:
    token = pair.tokens[0]
    assert _issue_error(pair, _open(""), token).code() == grpc.StatusCode.INVALID_ARGUMENT
    framing = _issue_error(pair, _open("t-framing", link_framing=7), token)
    assert framing.code() == grpc.StatusCode.INVALID_ARGUMENT and "link_framing" in (framing.details() or "")
    audited(pair, "edge.open", "t-framing")
    peer = _issue_error(pair, _open("t-peer", peer_cluster="zz"), token)
    assert peer.code() == grpc.StatusCode.NOT_FOUND
    audited(pair, "edge.open", "t-peer")
    garbage = _issue_error(pair, _open("t-garbage"), "not-a-token")
    assert garbage.code() == grpc.StatusCode.UNAUTHENTICATED
    other_cluster = _issue_error(pair, _open("t-other-cluster"), pair.tokens[1])
    assert other_cluster.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_job_token_gets_tickets_for_its_own_job_only(pair: SwitchPair) -> None:
    with internal_channel(pair.auth_addresses[0], service="auth") as channel:
        job_token = (
            auth_pb2_grpc.AuthStub(channel)
            .IssueJobToken(
                auth_pb2.IssueJobTokenRequest(job_id="t-mine"),
                metadata=bearer_metadata(pair.tokens[0]),
                timeout=10,
            )
            .token
        )
    assert _ticket(pair, _open("t-mine"), job_token)
    other = _issue_error(pair, _open("t-theirs"), job_token)
    assert other.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "t-mine" in (other.details() or "")
    audited(pair, "edge.open", "t-theirs")


def test_garbage_instead_of_a_ticket_is_refused(pair: SwitchPair, client: _Client) -> None:
    client.send(b"hello, switch")
    code, message = client.status()
    assert code == grpc.StatusCode.UNAUTHENTICATED and "ticket" in message
    assert client.closed()
    audited(pair, "edge.open", "32-byte edge ticket")
    _still_serves(pair, "h-after-garbage")


def test_a_connection_that_sends_no_ticket_is_refused_in_time(pair: SwitchPair, client: _Client) -> None:
    served = _edge_socket(pair)
    before, served.ticket_wait_s = served.ticket_wait_s, 0.5
    try:
        silent = _Client(pair.edge_sockets[0])
        code, message = silent.status()
        silent.close()
    finally:
        served.ticket_wait_s = before
    assert code == grpc.StatusCode.UNAUTHENTICATED and "no edge ticket within" in message
    audited(pair, "edge.open", "no edge ticket within")
    _still_serves(pair, "h-after-silence")


def test_connections_that_never_send_a_ticket_cannot_keep_a_genuine_edge_out(pair: SwitchPair) -> None:
    """A local peer (a stage in a container sees the socket's directory) opens more silent connections
    than may wait for a ticket: each new one pushes out the longest waiting, told to retry, and a
    genuine connection, whose ticket comes with it, still opens its edge."""
    extra = 8
    flood = [_Client(pair.edge_sockets[0]) for _ in range(MAX_UNTICKETED + extra)]
    try:
        _still_serves(pair, "h-beside-a-flood")
        for pushed in flood[: extra + 1]:  # the oldest: pushed out by the newer flood and the genuine one
            code, message = pushed.status()
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, message)
            assert "newer edge socket connections waited for a ticket" in message
        audited(pair, "edge.open", "newer edge socket connections waited for a ticket")
    finally:
        for silent in flood:
            silent.close()
    _still_serves(pair, "h-after-the-flood")


def test_a_ticket_is_used_once(pair: SwitchPair) -> None:
    ticket = _ticket(pair, _open("h-once"))
    first = _Client(pair.edge_sockets[0])
    first.send(ticket)
    assert relay_pb2.EdgeMessage.FromString(first.receive()).WhichOneof("body") == "ready"
    second = _Client(pair.edge_sockets[0])
    second.send(ticket)
    code, message = second.status()
    assert code == grpc.StatusCode.UNAUTHENTICATED and "unknown or already used" in message
    first.close()
    second.close()
    audited(pair, "edge.open", "unknown or already used")


def test_an_expired_ticket_is_refused(pair: SwitchPair, client: _Client) -> None:
    tickets = _edge_socket(pair).tickets
    before, tickets.ttl_s = tickets.ttl_s, 0.2
    try:
        ticket = _ticket(pair, _open("h-expired"))
    finally:
        tickets.ttl_s = before
    issued = time.monotonic()
    wait_for(lambda: time.monotonic() > issued + 0.3, 5, "the ticket's expiry")
    client.send(ticket)
    code, message = client.status()
    assert code == grpc.StatusCode.UNAUTHENTICATED and "expired" in message
    audited(pair, "edge.open", "expired")


def test_a_ticketed_edge_cannot_carry_another_jobs_chunks(pair: SwitchPair, client: _Client) -> None:
    client.send(_ticket(pair, _open("h-mine")))
    assert relay_pb2.EdgeMessage.FromString(client.receive()).WhichOneof("body") == "ready"
    chunk, _ = encode_chunk("h-theirs", "up->down", 0, 1, 0, b"x" * 1000, True)
    client.send(chunk)
    code, message = client.status()
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "h-theirs" in message
    audited(pair, "edge.refused", "h-theirs")
    _still_serves(pair, "h-after-theirs")


def test_a_record_over_the_bound_is_refused_before_any_buffer(pair: SwitchPair, client: _Client) -> None:
    client.sock.sendall((MAX_EDGE_RECORD_BYTES + 1).to_bytes(4, "big"))
    code, message = client.status()
    assert code == grpc.StatusCode.INVALID_ARGUMENT and f"limit {MAX_EDGE_RECORD_BYTES}" in message
    audited(pair, "edge.open", f"limit {MAX_EDGE_RECORD_BYTES}")
    _still_serves(pair, "h-after-big")


def test_a_record_over_the_bound_on_an_open_edge_ends_itaudited(pair: SwitchPair, client: _Client) -> None:
    client.send(_ticket(pair, _open("h-big-open")))
    assert relay_pb2.EdgeMessage.FromString(client.receive()).WhichOneof("body") == "ready"
    client.sock.sendall((MAX_EDGE_RECORD_BYTES + 1).to_bytes(4, "big"))
    wait_for(client.closed, 20, "the switch to end the connection")
    audited(pair, "edge.refused", f"limit {MAX_EDGE_RECORD_BYTES}")
    close = audited(pair, "edge.close", "h-big-open")
    assert close["outcome"] == "failure"
    _still_serves(pair, "h-after-big-open")


def test_a_stall_inside_a_record_ends_the_connection(pair: SwitchPair) -> None:
    served = _edge_socket(pair)
    before, served.stall_s = served.stall_s, 0.5
    try:
        staller = _Client(pair.edge_sockets[0])
        staller.sock.sendall((32).to_bytes(4, "big") + b"\1" * 5)  # a ticket record begun, never finished
        code, message = staller.status()
        staller.close()
    finally:
        served.stall_s = before
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "stalled" in message
    audited(pair, "edge.open", "stalled")
    _still_serves(pair, "h-after-stall")


def _requester(
    pair: SwitchPair, job_id: str, refusals: list[str], edge_socket: str = ""
) -> EdgeSocketRequester:
    """A stage's requester whose trainer (a real ``StageEdgeFds``) serves job ``job_id``'s one edge."""
    return stage_records_connector(pair, 0, job_id, {"up->down"}, edge_socket=edge_socket, refusals=refusals)


def test_a_stage_gets_a_connection_for_its_own_edge_only(pair: SwitchPair) -> None:
    refusals: list[str] = []
    request = _requester(pair, "s-mine", refusals)
    for job_id, edge in (("s-theirs", "up->down"), ("s-mine", "other->edge")):
        with pytest.raises(EdgeSocketRefused) as refused:
            request(_open(job_id, edge))
        assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert f"may not open edge {edge!r} of job {job_id!r}" in refused.value.message
    assert len(refusals) == 2
    conn, sealing = request(_open("s-mine"))  # the trainer still answers, and its own edge opens
    assert sealing is None  # a Unix socket: plain records
    try:
        conn.settimeout(30)
        head = conn.recv(4, socket.MSG_WAITALL)
        ready = relay_pb2.EdgeMessage.FromString(conn.recv(int.from_bytes(head, "big"), socket.MSG_WAITALL))
        assert ready.WhichOneof("body") == "ready"
    finally:
        conn.close()


def test_the_switchs_refusal_of_a_ticket_reaches_the_stage(pair: SwitchPair) -> None:
    request = _requester(pair, "s-framing", [])
    with pytest.raises(EdgeSocketRefused) as refused:
        request(_open("s-framing", link_framing=9))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "link_framing" in refused.value.message


def test_a_missing_edge_socket_is_unavailable_naming_it(pair: SwitchPair, tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such.sock")
    request = _requester(pair, "s-missing", [], edge_socket=missing)
    with pytest.raises(EdgeSocketRefused) as refused:
        request(_open("s-missing"))
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE and missing in refused.value.message


_IMPOSTOR = """
import os, socket, sys
os.setgroups([]); os.setgid(65534); os.setuid(65534)
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(sys.argv[1]); server.listen(1); server.settimeout(60)
print("listening", flush=True)
conn, _ = server.accept(); conn.settimeout(60)
received = b""
while chunk := conn.recv(4096):
    received += chunk
print(len(received), flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="binding a socket as another user needs root")
def test_a_socket_of_another_user_gets_no_ticket(pair: SwitchPair) -> None:
    """A process of another user bound at the edge socket's path (a writable directory, a replaced file)
    is not the switch: the trainer sends it nothing, and the stage is told why."""
    directory = Path(tempfile.mkdtemp(prefix="nebula-impostor-"))  # pytest's own tmp is closed to others
    directory.chmod(0o777)
    path = str(directory / "switch.sock")
    impostor = subprocess.Popen(
        [sys.executable, "-c", _IMPOSTOR, path], stdout=subprocess.PIPE, text=True, cwd="/"
    )
    try:
        assert impostor.stdout is not None
        assert impostor.stdout.readline().strip() == "listening", "the impostor did not start"
        request = _requester(pair, "s-impostor", [], edge_socket=path)
        with pytest.raises(EdgeSocketRefused) as refused:
            request(_open("s-impostor"))
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        assert "runs as user 65534" in refused.value.message and "no ticket sent" in refused.value.message
        received, _ = impostor.communicate(timeout=30)
        assert received.strip() == "0", f"the impostor received {received.strip()} bytes"
    finally:
        impostor.kill()
        impostor.wait(timeout=30)
        shutil.rmtree(directory, ignore_errors=True)


def test_garbage_on_the_stages_request_channel_is_refused(pair: SwitchPair) -> None:
    refusals: list[str] = []
    proxy_side, stage_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proxy = stage_proxy(pair, 0, "s-garbage", {"up->down"}, refusals)
    StageEdgeFds(proxy_side, proxy, pair.edge_sockets[0], "s-garbage").start()
    stage_side.settimeout(30)
    stage_side.send(b"\xff" * 20)
    answer = json.loads(stage_side.recv(4096))
    assert answer["code"] == "INVALID_ARGUMENT" and "not an EdgeOpen" in answer["message"]
    assert refusals
    stage_side.close()
