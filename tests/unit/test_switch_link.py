"""The switch's link rules, pinned without the WAN: handshake checks, identity checks, routing, counters."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from pydantic import ValidationError

from nebula_common.pki import Identity
from nebula_common.proto.nebula.v1 import link_pb2, relay_pb2, tensor_pb2
from nebula_common.rpc.framing import LINK_FRAMING_VERSION, encode_chunk, parse_chunk
from services.switch.config import SwitchSettings
from services.switch.link import PeerLink
from services.switch.link_handshake import PROTOCOL_VERSION, HandshakeError
from services.switch.metrics import DirectionCounters
from services.switch.route_state import RouteInUseError
from services.switch.routing import Router

pytestmark = pytest.mark.timeout(30)


def routed(item: relay_pb2.EdgeMessage) -> link_pb2.LinkMessage:
    return link_pb2.LinkMessage(routed=link_pb2.RoutedItem(job_id="j", edge="e", item=item))


def hello(
    cluster: str, version: int = PROTOCOL_VERSION, framing: int = LINK_FRAMING_VERSION
) -> link_pb2.LinkMessage:
    return link_pb2.LinkMessage(
        hello=link_pb2.Handshake(protocol_version=version, cluster_id=cluster, link_framing=framing)
    )


def make_link() -> PeerLink:
    return PeerLink("a", "b", Router())


def test_handshake_must_agree_with_the_certificate() -> None:
    link = make_link()
    link.check_hello(hello("b"), Identity("b", "switch"))
    with pytest.raises(HandshakeError, match="claims cluster 'c' but its certificate says 'b'"):
        link.check_hello(hello("c"), Identity("b", "switch"))


def test_handshake_refuses_another_protocol_version_and_non_hello_first_message() -> None:
    link = make_link()
    with pytest.raises(HandshakeError, match="protocol 1, this switch speaks 2"):
        link.check_hello(hello("b", version=1), Identity("b", "switch"))
    frame = link_pb2.LinkMessage(routed=link_pb2.RoutedItem(job_id="j", edge="e"))
    with pytest.raises(HandshakeError, match="did not start with a handshake"):
        link.check_hello(frame, Identity("b", "switch"))


@pytest.mark.parametrize("framing", [0, 2])
def test_handshake_refuses_a_peer_without_link_framing(framing: int) -> None:
    with pytest.raises(
        HandshakeError, match=rf"Handshake.link_framing {framing} is not supported: it must be 1"
    ):
        make_link().check_hello(hello("b", framing=framing), Identity("b", "switch"))


@pytest.mark.parametrize(
    "certified", [Identity("c", "switch"), Identity("b", "operator"), Identity("a", "switch")]
)
def test_only_the_configured_peer_switch_may_link(certified: Identity) -> None:
    with pytest.raises(PermissionError, match="only spiffe://nebula/cluster/b/switch may connect"):
        make_link().check_identity(certified)


def test_counters_account_headers_chunks_and_raw_size() -> None:
    counters = DirectionCounters("sent")
    header = tensor_pb2.TensorHeader(frame_id=1, raw_size=4096, payload_size=1024)
    chunk = tensor_pb2.TensorChunk(frame_id=1, data=b"x" * 1024, last=True)
    messages = [
        routed(relay_pb2.EdgeMessage(frame=tensor_pb2.TensorFrame(header=header))),
        routed(relay_pb2.EdgeMessage(frame=tensor_pb2.TensorFrame(chunk=chunk))),
        routed(relay_pb2.EdgeMessage(ack=relay_pb2.EdgeAck(received=1, max_bytes=10))),
        hello("a"),
    ]
    for message in messages:
        counters.count(message)
    assert counters.frames == 1
    assert counters.raw_bytes == 4096
    assert counters.payload_bytes == 1024
    assert counters.bytes == sum(m.ByteSize() for m in messages)


def test_router_buffers_until_the_trainer_attaches_and_refuses_a_second_attach() -> None:
    async def scenario() -> None:
        router = Router()
        key = ("job", "encoder->decoder")
        early = relay_pb2.EdgeMessage(
            frame=tensor_pb2.TensorFrame(header=tensor_pb2.TensorHeader(frame_id=7))
        )
        router.deliver(key, early)
        route, attachment = router.attach(key, owner="alice")
        message = router.pop_inbound(route, attachment)
        assert message is not None and message.frame.header.frame_id == 7
        with pytest.raises(RouteInUseError, match=r"already open|not available to this account"):
            router.attach(key, owner="mallory")
        with pytest.raises(RouteInUseError, match="already open"):
            router.attach(key, owner="alice")  # without reconnect: refused as a second opener
        assert router.open_routes() == 1

    asyncio.run(scenario())


def test_router_drops_buffered_frames_of_an_edge_closed_before_anyone_opened_it() -> None:
    async def scenario() -> None:
        router = Router()
        key = ("job", "e")
        router.deliver(key, relay_pb2.EdgeMessage(frame=tensor_pb2.TensorFrame()))
        router.deliver(key, relay_pb2.EdgeMessage(close=relay_pb2.EdgeClose(reason="cancelled")))
        route, attachment = router.attach(key, owner="alice")
        assert router.pop_inbound(route, attachment) is None
        assert router.buffered_in == 0

    asyncio.run(scenario())


def switch_env(**overrides: str) -> dict[str, str]:
    env = {
        "cluster_id": "a",
        "peer_cluster_id": "b",
        "tls_cert": "/pki/a/switch.crt",
        "tls_key": "/pki/a/switch.key",
        "trust_bundle": "/pki/a/trust-bundle.pem",
        "auth_address": "127.0.0.1:1",
        "data_dir": "/var/lib/nebula/switch",
    }
    env.update(overrides)
    return env


def test_settings_decide_who_dials() -> None:
    assert SwitchSettings(**switch_env(peer_address="wan:7000")).dials()
    assert not SwitchSettings(
        **switch_env(cluster_id="c", peer_cluster_id="b", peer_address="wan:7000")
    ).dials()
    assert not SwitchSettings(**switch_env()).dials()  # nowhere to dial
    assert SwitchSettings(**switch_env(link_role="dial", peer_address="x:1")).dials()


def test_settings_refuse_a_peer_equal_to_itself_and_name_missing_fields() -> None:
    with pytest.raises(ValidationError, match="peer_cluster_id must differ"):
        SwitchSettings(**switch_env(peer_cluster_id="a"))
    env = switch_env()
    del env["trust_bundle"]
    with pytest.raises(ValidationError, match="trust_bundle"):
        SwitchSettings(**env)
    with pytest.raises(ValidationError, match="cluster_id"):
        SwitchSettings(**switch_env(cluster_id="Bad Id"))
    with pytest.raises(ValidationError, match="ca_cert and ca_key must be set together"):
        SwitchSettings(**switch_env(ca_key="/pki/a/ca.key"))
    env = switch_env()
    del env["data_dir"]
    with pytest.raises(ValidationError, match="data_dir"):
        SwitchSettings(**env)


def test_the_orphan_timeout_defaults_to_two_minutes_reads_its_env_and_refuses_nonsense(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert SwitchSettings(**switch_env()).orphan_timeout_s == 120.0
    monkeypatch.setenv("NEBULA_SWITCH_ORPHAN_TIMEOUT_S", "7.5")
    assert SwitchSettings(**switch_env()).orphan_timeout_s == 7.5
    monkeypatch.setenv("NEBULA_SWITCH_ORPHAN_TIMEOUT_S", "0")
    with pytest.raises(ValueError, match="orphan_timeout_s"):
        SwitchSettings(**switch_env())


def test_account_weights_read_from_the_environment_or_refused_naming_the_entry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert SwitchSettings(**switch_env()).account_weights == {}
    monkeypatch.setenv("NEBULA_SWITCH_ACCOUNT_WEIGHTS", "alice=4, bob=2")
    assert SwitchSettings(**switch_env()).account_weights == {"alice": 4, "bob": 2}
    monkeypatch.setenv("NEBULA_SWITCH_ACCOUNT_WEIGHTS", '{"carol": 3}')
    assert SwitchSettings(**switch_env()).account_weights == {"carol": 3}
    for bad, reason in [("alice:4", "'alice:4' is not ACCOUNT=WEIGHT"), ("alice=0", "weight 0 of 'alice'")]:
        monkeypatch.setenv("NEBULA_SWITCH_ACCOUNT_WEIGHTS", bad)
        with pytest.raises(ValidationError, match=reason):
            SwitchSettings(**switch_env())


def test_a_framed_chunk_goes_out_byte_for_byte() -> None:
    async def scenario() -> list[bytes]:
        router = Router(cluster_id="a")
        link = PeerLink("a", "b", router)
        route, attachment = router.attach(("j", "e"), "alice")
        raw, _ = encode_chunk("j", "e", 0, 1, 0, b"x" * 1000, True)
        written: list[bytes] = []
        stop = asyncio.Event()

        async def read() -> object:
            await stop.wait()
            return grpc.aio.EOF

        async def write(message: bytes) -> None:
            if link_pb2.LinkMessage.FromString(message).WhichOneof("body") != "ping":
                written.append(message)
                stop.set()

        session = asyncio.create_task(link.run_session(read, write, Identity("b", "switch"), "dialer"))
        assert await link.wait_connected(5)  # a session start purges what was queued before it
        router.accept_local(route, attachment, parse_chunk(raw))
        await asyncio.wait_for(session, 5)
        return written

    written = asyncio.run(scenario())
    raw, _ = encode_chunk("j", "e", 0, 1, 0, b"x" * 1000, True)
    assert written[0] == raw
    assert link_pb2.LinkMessage.FromString(written[0]).WhichOneof("body") == "framed"


def test_the_hello_announces_link_framing() -> None:
    assert make_link().hello().hello.link_framing == LINK_FRAMING_VERSION


def test_a_writer_blocked_in_a_write_counts_as_a_busy_link() -> None:
    """With several lanes the backlog sits in the connections' writes, not in the router: the lane
    tuner (which only judges busy intervals) must still see a full link as busy."""

    async def scenario() -> tuple[bool, bool, bool, bool]:
        router = Router(cluster_id="a")
        link = PeerLink("a", "b", router)
        route, attachment = router.attach(("j", "e"), "alice")
        raw, _ = encode_chunk("j", "e", 0, 1, 0, b"x" * 1000, True)
        stop, blocked, drain = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def read() -> object:
            await stop.wait()
            return grpc.aio.EOF

        async def write(message: bytes) -> None:
            if link_pb2.LinkMessage.FromString(message).WhichOneof("body") != "ping":
                blocked.set()
                await drain.wait()  # the link is full: the write does not complete yet

        session = asyncio.create_task(link.run_session(read, write, Identity("b", "switch"), "dialer"))
        assert await link.wait_connected(5)
        idle = link.link_busy()
        router.accept_local(route, attachment, parse_chunk(raw))
        await asyncio.wait_for(blocked.wait(), 5)
        full = (router.has_outbound(), link.link_busy())
        drain.set()
        for _ in range(100):  # the write completes and nothing else is queued
            if not link.link_busy():
                break
            await asyncio.sleep(0.01)
        drained = link.link_busy()
        stop.set()
        await asyncio.wait_for(session, 5)
        return idle, *full, drained

    idle, backlog, busy, drained = asyncio.run(scenario())
    assert not idle
    assert not backlog  # the writer took the item: the router alone would call this link idle
    assert busy
    assert not drained


def test_the_link_module_still_exports_what_moved_to_its_parts() -> None:
    """Callers of the one-module link keep working: each name is the part's own object, not a copy."""
    from services.switch import link, link_handshake, link_pumps, link_transport, liveness

    for module in (link_handshake, link_pumps, link_transport, liveness):
        for name in link.__all__:
            if hasattr(module, name):
                assert getattr(link, name) is getattr(module, name), name
    assert set(link.__all__) <= set(dir(link))


def test_the_rawlink_module_still_exports_what_moved_to_its_parts() -> None:
    """Callers of the one-module raw link transport keep working: each name is the part's own object."""
    from services.switch import rawlink, rawlink_acceptor, rawlink_connection, rawlink_dialer, wan_frontend

    for module in (rawlink_acceptor, rawlink_connection, rawlink_dialer, wan_frontend):
        for name in rawlink.__all__:
            if hasattr(module, name):
                assert getattr(rawlink, name) is getattr(module, name), name
    assert set(rawlink.__all__) <= set(dir(rawlink))


def test_the_server_module_still_exports_what_moved_to_its_parts() -> None:
    """Callers of the one-module switch server keep working: each name is the part's own object."""
    from services.switch import server, server_internal, server_peers, server_tasks, server_wan

    for module in (server_internal, server_peers, server_tasks, server_wan):
        for name in server.__all__:
            if hasattr(module, name):
                assert getattr(server, name) is getattr(module, name), name
    assert set(server.__all__) <= set(dir(server))
    assert server.LINK_WINDOW_BYTES == 1 << 20
    assert server.MAINTENANCE_INTERVAL_S == 1.0
    assert server.CERT_CHECK_INTERVAL_S == 5.0
