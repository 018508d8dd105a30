"""A switch with several peers: its settings, which link a caller or an edge gets, shared route limits."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from nebula_common.pki import Identity
from nebula_common.proto.nebula.v1 import relay_pb2, tensor_pb2
from services.switch.config import PeerSettings, SwitchSettings
from services.switch.link import PeerLink
from services.switch.peers import PeerLinks, PeerNotNamedError, UnknownPeerError
from services.switch.route_limits import Limits
from services.switch.route_state import RouteInUseError, RouteLimitError
from services.switch.route_table import SharedRoutes
from services.switch.routing import Router

BASE = {
    "cluster_id": "b",
    "tls_cert": "/pki/b/switch.crt",
    "tls_key": "/pki/b/switch.key",
    "trust_bundle": "/pki/b/trust-bundle.pem",
    "auth_address": "127.0.0.1:1",
    "data_dir": "/var/lib/nebula/switch",
}


def settings(**fields: object) -> SwitchSettings:
    return SwitchSettings(**{**BASE, **fields})


def test_single_peer_settings_are_a_list_of_one() -> None:
    one = settings(peer_cluster_id="c", peer_address="wan-c:7443", peer_crl="/pki/b/trust/c.crl.pem")
    assert one.peer_list() == [
        PeerSettings(cluster_id="c", address="wan-c:7443", link_role="auto", crl="/pki/b/trust/c.crl.pem")
    ]
    assert one.dials()  # b sorts before c and knows where c is


def test_peers_short_form_json_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    short = settings(peers=" a , c=wan-c:7443 ")
    assert [(p.cluster_id, p.address) for p in short.peer_list()] == [("a", None), ("c", "wan-c:7443")]
    assert [p.dials("b") for p in short.peer_list()] == [False, True]  # a dials b; b dials c
    monkeypatch.setenv(
        "NEBULA_SWITCH_PEERS",
        '[{"cluster_id": "a", "address": "wan-a:7443", "link_role": "accept"}, '
        '{"cluster_id": "c", "crl": "/pki/b/trust/c.crl.pem"}]',
    )
    from_env = SwitchSettings(**BASE)
    a, c = from_env.peer_list()
    assert (a.address, a.link_role, a.dials("b")) == ("wan-a:7443", "accept", False)
    assert str(c.crl) == "/pki/b/trust/c.crl.pem" and not c.dials("b")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "no peer configured"),
        ({"peers": "a", "peer_cluster_id": "c"}, "either peers or peer_cluster_id"),
        ({"peers": "a,c,a"}, "names a cluster twice"),
        ({"peers": "a,b"}, "own cluster 'b'"),
        ({"peers": "a,=x:1"}, "names no cluster"),
        ({"peers": "a,C"}, "cluster_id"),
        ({"peers": "a,c=nowhere"}, "host:port"),
        ({"peers": '[{"cluster_id": "c", "link_role": "dial"}]'}, "'c' has link_role 'dial' but no"),
        ({"peers": '[{"cluster_id": "c"'}, "not a valid JSON list"),
        ({"peers": '[{"cluster_id": "c", "adress": "x:1"}]'}, "adress"),
    ],
)
def test_bad_peer_settings_are_refused_naming_the_problem(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        settings(**fields)


def _links(*peers: str) -> PeerLinks:
    shared = SharedRoutes()
    return PeerLinks("b", [PeerLink("b", peer, Router(cluster_id="b", shared=shared)) for peer in peers])


def test_the_callers_certificate_picks_its_link_and_others_are_refused() -> None:
    async def scenario() -> None:
        links = _links("a", "c")
        assert links.select(Identity("c", "switch")) is links.get("c")
        assert links.select(Identity("a", "switch")) is links.get("a")
        with pytest.raises(PermissionError, match="only spiffe://nebula/cluster/a/switch, spiffe://nebula"):
            links.select(Identity("d", "switch"))
        with pytest.raises(PermissionError, match="cluster/c/operator"):
            links.select(Identity("c", "operator"))
        single = _links("a")
        with pytest.raises(PermissionError, match="but only spiffe://nebula/cluster/a/switch may connect"):
            single.select(Identity("c", "switch"))

    asyncio.run(scenario())


def test_an_edge_goes_to_the_peer_it_names_or_the_only_one() -> None:
    async def scenario() -> None:
        links = _links("a", "c")
        assert links.for_edge("c") is links.get("c")
        with pytest.raises(UnknownPeerError, match="no link to cluster 'z' \\(its peers: a, c\\)"):
            links.for_edge("z")
        with pytest.raises(PeerNotNamedError, match="links to clusters a, c"):
            links.for_edge("")
        single = _links("a")
        assert single.for_edge("") is single.first is single.for_edge("a")

    asyncio.run(scenario())


def test_items_from_a_peer_reach_only_its_own_routes_and_limits_count_every_route() -> None:
    async def scenario() -> None:
        shared = SharedRoutes()
        limits = Limits(max_routes_per_account=2, max_attached_routes=3)
        to_a, to_c = (Router(limits, cluster_id="b", shared=shared) for _ in "ac")
        key = ("job", "e")
        route_a, at_a = to_a.attach(key, owner="alice")
        route_c, at_c = to_c.attach(key, owner="alice")  # the same key toward another peer: its own route
        to_c.deliver(key, relay_pb2.EdgeMessage(frame=tensor_pb2.TensorFrame()))
        assert to_a.pop_inbound(route_a, at_a) is None
        got = to_c.pop_inbound(route_c, at_c)
        assert got is not None and got.WhichOneof("body") == "frame"
        # One account per job across the switch, and the per-account limit counts both peers' routes.
        with pytest.raises(RouteInUseError):
            to_a.attach(("job", "other"), owner="mallory")
        with pytest.raises(RouteLimitError, match="account 'alice' already has 2 edges"):
            to_a.attach(("job2", "e"), owner="alice")
        to_c.attach(("job3", "e"), owner="bob")
        with pytest.raises(RouteLimitError, match="already has 3 edges open"):
            to_a.attach(("job4", "e"), owner="carol")
        assert to_a.open_routes() == to_c.open_routes() == 3

    asyncio.run(scenario())


def test_the_link_carrier_is_records_unless_grpc_is_chosen_and_another_value_is_refused_by_name() -> None:
    peer = {"peer_cluster_id": "a", "peer_address": "wan-a:7443"}
    assert settings(**peer).link_carrier == "records"
    assert settings(**peer, link_carrier="grpc").link_carrier == "grpc"
    for old in ("raw", "sealed", "tls"):  # the values of the two settings it replaced
        with pytest.raises(ValidationError, match=r"link_carrier\n.*'records' or 'grpc'"):
            settings(**peer, link_carrier=old)
