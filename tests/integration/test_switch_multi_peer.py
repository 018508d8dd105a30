"""A switch with several peers: three real clusters in a chain a - b - c (mTLS links, real auth).

* b's links to a and to c are up at once; an edge a->b and an edge b->c carry tensors concurrently,
  each over its own link (b's per-peer counters and GetLinkStatus per peer);
* items from peer X reach only routes of X: the same (job, edge) opened on b toward a and toward c
  receives only what its own peer sent;
* an edge naming a cluster b has no link to is refused with NOT_FOUND naming it, and one naming none
  on a switch with two peers with FAILED_PRECONDITION;
* cutting the b-c link (c's switch stops) leaves the a-b link and its edge undisturbed;
* revoking c's switch certificate on c's side (its CRL reaches b over the b-c exchange) closes only
  the b-c link.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from cryptography import x509
from prometheus_client import REGISTRY

from nebula_common.cli import job as job_cli
from nebula_common.clients.endpoints import ClusterEndpoints
from nebula_common.errors import NebulaError
from nebula_common.pki import PkiLayout, init_pki
from nebula_common.pki.lifecycle import revoke_certificate
from nebula_common.proto.nebula.v1 import relay_pb2, relay_pb2_grpc
from nebula_common.rpc import bearer_metadata
from nebula_common.rpc.framing import LINK_FRAMING_VERSION
from nebula_common.sdk.client import ClusterSession
from nebula_common.sdk.summary import JobSummary
from services.trainer.edge import EdgeConnection, EdgeSettings
from tests.support.edges import in_threads, wait_for
from tests.support.switch_mesh import Chain, switch_chain

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
SETTINGS = EdgeSettings(window_bytes=1 << 20, max_outage_s=60, retransmit_s=1.0, ready_timeout_s=30)
_jobs = itertools.count()


@pytest.fixture(scope="module")
def pki_abc(tmp_path_factory: pytest.TempPathFactory) -> PkiLayout:
    return init_pki(tmp_path_factory.mktemp("pki"), ["a", "b", "c"])


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory, pki_abc: PkiLayout) -> Iterator[Chain]:
    with switch_chain(tmp_path_factory.mktemp("chain"), pki_abc) as running:
        yield running


def _audit(chain: Chain, cluster: str, event: str) -> list[dict[str, Any]]:
    path = Path(chain.switches[cluster].running.audit.path)
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r["event"] == event]


def _exchange(up: EdgeConnection, down: EdgeConnection, value: float, steps: int = 4) -> list[torch.Tensor]:
    """``steps`` tensors down the edge and one back per step; returns what the downstream end got."""
    got = []
    for step in range(steps):
        up.send_tensor(torch.full((64, 32), value + step), step, 0)
        got.append(down.receive_tensor(step, 0, timeout=30))
        down.send_tensor(torch.full((64, 32), -(value + step)), step, 0)
        back = up.receive_tensor(step, 0, timeout=30)
        assert torch.equal(back, torch.full((64, 32), -(value + step)))
    return got


def _close(*ends: EdgeConnection) -> None:
    closers = [threading.Thread(target=end.close, daemon=True) for end in ends]
    for closer in closers:
        closer.start()
    for closer in closers:
        closer.join(30)
    assert not any(closer.is_alive() for closer in closers), "an edge did not close within 30 s"


def test_both_links_up_and_two_edges_carry_data_concurrently(chain: Chain) -> None:
    b = chain.switches["b"].running
    assert sorted(b.links.peer_ids) == ["a", "c"]
    assert all(link.connected for link in b.links)
    job = f"chain-{next(_jobs)}"
    ab = chain.edge_pair(job, "s0->s1", ("a", "b"), SETTINGS)
    bc = chain.edge_pair(job, "s1->s2", ("b", "c"), SETTINGS)
    sent_before = {peer: b.links.get(peer).sent.to_proto().frames for peer in ("a", "c")}  # type: ignore[union-attr]
    started = time.monotonic()
    got_ab, got_bc = in_threads(lambda: _exchange(*ab, 1.0), lambda: _exchange(*bc, 100.0))
    elapsed = time.monotonic() - started
    assert [t[0, 0].item() for t in got_ab] == [1.0, 2.0, 3.0, 4.0]  # type: ignore[attr-defined]
    assert [t[0, 0].item() for t in got_bc] == [100.0, 101.0, 102.0, 103.0]  # type: ignore[attr-defined]
    _close(*ab, *bc)
    # Each edge crossed its own link: b sent 4 gradients to a and 4 activations to c.
    for peer in ("a", "c"):
        link = b.links.get(peer)
        assert link is not None
        assert link.sent.to_proto().frames - sent_before[peer] >= 4, peer
    opened = [r["details"] for r in _audit(chain, "b", "edge.open") if r["job_id"] == job]
    assert sorted(d["peer"] for d in opened) == ["a", "c"], opened
    with grpc.insecure_channel(chain.switches["b"].internal_address) as channel:
        relay = relay_pb2_grpc.RelayStub(channel)
        metadata = bearer_metadata(chain.tokens["b"])
        for peer in ("a", "c"):
            status = relay.GetLinkStatus(relay_pb2.GetLinkStatusRequest(peer_cluster=peer), metadata=metadata)
            assert status.connected and status.expected_peer == peer
            assert status.verified_peer_identity == f"spiffe://nebula/cluster/{peer}/switch"
    print(f"two edges through b, concurrently: 2 x 4 round trips in {elapsed:.2f}s")


def test_items_from_one_peer_reach_only_that_peers_routes(chain: Chain) -> None:
    job = f"same-key-{next(_jobs)}"
    from_a = chain.edge_pair(job, "e", ("a", "b"), SETTINGS)
    from_c = chain.edge_pair(job, "e", ("c", "b"), SETTINGS)
    got_a, got_c = in_threads(lambda: _exchange(*from_a, 10.0), lambda: _exchange(*from_c, 20.0))
    assert [t[0, 0].item() for t in got_a] == [10.0, 11.0, 12.0, 13.0]  # type: ignore[attr-defined]
    assert [t[0, 0].item() for t in got_c] == [20.0, 21.0, 22.0, 23.0]  # type: ignore[attr-defined]
    _close(*from_a, *from_c)


def _open(chain: Chain, cluster: str, job: str, peer: str) -> grpc.RpcError:
    opened = relay_pb2.EdgeOpen(job_id=job, edge="e", peer_cluster=peer, link_framing=LINK_FRAMING_VERSION)
    with grpc.insecure_channel(chain.switches[cluster].internal_address) as channel:
        call = relay_pb2_grpc.RelayStub(channel).OpenEdge(
            iter([relay_pb2.EdgeMessage(open=opened)]),
            metadata=bearer_metadata(chain.tokens[cluster]),
        )
        with pytest.raises(grpc.RpcError) as caught:
            for _ in call:
                pass
        return caught.value


def test_an_edge_to_an_unknown_or_unnamed_peer_is_refused_clearly(chain: Chain) -> None:
    error = _open(chain, "b", f"lost-{next(_jobs)}", "z")
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "no link to cluster 'z'" in error.details() and "a, c" in error.details(), error.details()
    error = _open(chain, "b", f"unnamed-{next(_jobs)}", "")
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "EdgeOpen.peer_cluster" in error.details(), error.details()
    refused = [r for r in _audit(chain, "b", "edge.open") if r["outcome"] == "refused"]
    assert any(r["details"].get("peer") == "z" for r in refused), refused
    # a has one peer: it may name it or not, but not another cluster.
    error = _open(chain, "a", f"wrong-{next(_jobs)}", "c")
    assert error.code() == grpc.StatusCode.NOT_FOUND and "'c'" in error.details()
    request = relay_pb2.GetLinkStatusRequest(peer_cluster="z")
    with (
        grpc.insecure_channel(chain.switches["b"].internal_address) as channel,
        pytest.raises(grpc.RpcError) as caught,
    ):
        relay_pb2_grpc.RelayStub(channel).GetLinkStatus(request, metadata=bearer_metadata(chain.tokens["b"]))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    # The SDK asks for one peer's link the same way.
    endpoints = ClusterEndpoints(
        cluster_id="b",
        auth=chain.auths["b"].address,
        trainer="127.0.0.1:1",  # not called here
        switch=chain.switches["b"].internal_address,
    )
    session = ClusterSession(endpoints, chain.tokens["b"], "admin")
    try:
        assert session.link_status("c").connected and session.link_status("c").expected_peer == "c"
        assert session.link_status().expected_peer == "a"  # the first configured peer
        with pytest.raises(NebulaError, match="no link to cluster 'z'"):
            session.link_status("z")
    finally:
        session.close()


def _session(chain: Chain, cluster: str) -> ClusterSession:
    endpoints = ClusterEndpoints(
        cluster_id=cluster,
        auth=chain.auths[cluster].address,
        trainer="127.0.0.1:1",  # not called here
        switch=chain.switches[cluster].internal_address,
    )
    return ClusterSession(endpoints, chain.tokens[cluster], "admin")


def test_each_peer_link_has_its_own_metrics_status_and_summary_row(chain: Chain) -> None:
    """b's link gauges carry a ``peer`` label (one series per link, not the last writer's value);
    its LinkStatus lists both peers, and a job's summary names the link toward the job's other
    cluster and lists every link of a switch with several peers."""
    # The three switches share this process's registry; only b has links to a and to c.
    for peer in ("a", "c"):
        wait_for(
            lambda peer=peer: REGISTRY.get_sample_value("nebula_switch_link_rtt_seconds", {"peer": peer}),
            30,
            f"an RTT sample of b's link to {peer}",
        )
        assert REGISTRY.get_sample_value("nebula_switch_link_connections", {"peer": peer}) == 1, peer
        assert REGISTRY.get_sample_value("nebula_switch_peer_link_up", {"peer": peer}) == 1, peer
        assert REGISTRY.get_sample_value("nebula_switch_crl_stale", {"peer": peer}) is not None, peer
        assert REGISTRY.get_sample_value("nebula_switch_peer_crl_number", {"peer": peer}) is not None, peer
    b, c = _session(chain, "b"), _session(chain, "c")
    try:
        assert list(b.link_status().peers) == ["a", "c"]
        statuses = b.link_statuses()
        assert list(statuses) == ["a", "c"]
        for peer, status in statuses.items():
            assert (
                status.connected and status.verified_peer_identity == f"spiffe://nebula/cluster/{peer}/switch"
            )
        assert list(c.link_statuses()) == ["b"]
        # A job b -> c: b's identity row is its link to c, not its first peer a.
        summary = JobSummary(job_id="summary-b-c", steps=0)
        summary.fill_wan(b, c)
        assert summary.peer_identities == {
            "b": "spiffe://nebula/cluster/c/switch",
            "c": "spiffe://nebula/cluster/b/switch",
        }
        assert sorted(summary.links["b"]) == ["a", "c"] and list(summary.links["c"]) == ["b"]
        assert summary.to_json()["links"]["b"]["a"]["connected"] is True
        with job_cli.console.capture() as captured:
            job_cli.print_summary(summary)
        text = captured.get()
        assert "switch b link to a" in text and "switch b link to c" in text, text
        assert "switch c verified peer" in text, text
    finally:
        b.close()
        c.close()


def _link_stays_up(chain: Chain, peer: str) -> Callable[[], None]:
    """Watch b's link to ``peer`` from now on; the returned check fails if it ever went down."""
    link = chain.switches["b"].running.links.get(peer)
    assert link is not None and link.connected
    sessions = link.state.sessions
    downs: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if not link.connected:
                downs.append(time.monotonic())
            stop.wait(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()

    def check() -> None:
        stop.set()
        watcher.join(5)
        assert not downs, f"b's link to {peer} went down"
        assert link.state.sessions == sessions, f"b's link to {peer} reconnected"

    return check


def test_cutting_the_b_c_link_does_not_disturb_a_b(tmp_path: Path, pki_abc: PkiLayout) -> None:
    with switch_chain(tmp_path, pki_abc) as chain:
        b = chain.switches["b"].running
        ab = chain.edge_pair("cut", "s0->s1", ("a", "b"), SETTINGS)
        bc = chain.edge_pair("cut", "s1->s2", ("b", "c"), SETTINGS)
        _exchange(*ab, 1.0, steps=1)
        _exchange(*bc, 5.0, steps=1)
        a_b_undisturbed = _link_stays_up(chain, "a")
        cut = time.monotonic()
        chain.stop("c")
        link_c = b.links.get("c")
        assert link_c is not None
        wait_for(lambda: not link_c.connected, 30, "b to see its link to c go down")
        print(f"b-c link down {time.monotonic() - cut:.2f}s after c stopped")
        # The a-b edge keeps moving while b-c is down, on the same session.
        got = _exchange(*ab, 10.0, steps=4)
        assert [t[0, 0].item() for t in got] == [10.0, 11.0, 12.0, 13.0]  # type: ignore[attr-defined]
        a_b_undisturbed()
        assert b.links.get("a").connected  # type: ignore[union-attr]
        _close(*ab)
        bc[0].abort("test over")
        bc[1].abort("test over")
        downs = [r["details"] for r in _audit(chain, "b", "link.down")]
        assert [d["peer"] for d in downs] == ["spiffe://nebula/cluster/c/switch"], downs


def test_revoking_c_on_c_side_closes_only_the_b_c_link(tmp_path: Path) -> None:
    pki = init_pki(tmp_path / "pki", ["a", "b", "c"])
    with switch_chain(tmp_path, pki) as chain:
        b = chain.switches["b"].running
        a_b_undisturbed = _link_stays_up(chain, "a")
        serial = x509.load_pem_x509_certificate(pki.cluster("c").switch_cert.read_bytes()).serial_number
        revoked = time.monotonic()
        revoke_certificate(pki.root, "c", serial, reason="test: c's switch key leaked")
        link_c = b.links.get("c")
        assert link_c is not None
        wait_for(lambda: not link_c.connected, 10, "b to close its link to the revoked c")
        closed_after = time.monotonic() - revoked
        wait_for(
            lambda: [
                r
                for r in _audit(chain, "b", "link.refused")
                if r["details"]["layer"] == "revoked" and "cluster/c/" in r["details"].get("identity", "")
            ],
            15,
            "b's refusal of c's revoked certificate",
        )
        applied = [r["details"] for r in _audit(chain, "b", "crl.apply")]
        assert any(d["source"] == "link" and d["revoked"] == 1 for d in applied), applied
        assert b.trusts["c"].loaded is not None and serial in b.trusts["c"].crl_serials
        assert b.trusts["a"].loaded is None or serial not in b.trusts["a"].crl_serials
        # a - b carries on: an edge opened now crosses it.
        ab = chain.edge_pair("after-revoke", "s0->s1", ("a", "b"), SETTINGS)
        got = _exchange(*ab, 3.0, steps=2)
        assert [t[0, 0].item() for t in got] == [3.0, 4.0]  # type: ignore[attr-defined]
        _close(*ab)
        a_b_undisturbed()
        assert not link_c.connected
        print(f"revoked c on c's side; b closed only its link to c after {closed_after:.2f}s")
