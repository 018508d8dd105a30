"""The switch data plane between two real switches (mTLS link, real auth), raw Relay clients as trainers.

* a flooding route with no receiver is closed with a reason naming the bound, audited, while a healthy
  route keeps moving; a receiver that never reads is closed the same way without delaying anyone;
* a link session that ends tells attached trainers (notice down, then up) and items flow again;
* reconnect takeover, the per-account route limit, the unattached timeout, credit enforcement on the
  sending side, and the WAN port's handshake timeout;
* link framing: a framed chunk crosses both switches byte for byte, a chunk tagged for another route or
  epoch is refused and audited, and so are an edge open and a link handshake announcing no link framing.
"""

from __future__ import annotations

import asyncio
import json
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY

from nebula_common.pki import Identity, PkiLayout, channel_options
from nebula_common.proto.nebula.v1 import link_pb2, link_pb2_grpc, relay_pb2, tensor_pb2
from nebula_common.rpc import bearer_metadata
from nebula_common.rpc.framing import LINK_FRAMING_VERSION, encode_chunk, is_framed
from nebula_common.sdk.auth_client import AuthClient
from nebula_common.wan.emulator import LinkShape, WanEmulator
from services.switch.config import SwitchSettings
from services.switch.express import EXPRESS_LANE
from services.switch.link_handshake import PROTOCOL_VERSION
from services.switch.route_limits import UNATTACHED_MAX_ITEMS
from services.switch.throttle import PAUSE_S
from tests.support.accounts import ADMIN_PASSWORD, auth_settings
from tests.support.servers import AuthServerThread, SwitchThread, running_auth
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
ACCOUNTS = ("alice", "bob", "carol", "dave", "mallory")
PASSWORD = "a-long-enough-test-password"


class Cluster:
    def __init__(self, auth: AuthServerThread, tokens: dict[str, str]) -> None:
        self.auth = auth
        self.tokens = tokens


@pytest.fixture(scope="module")
def clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Cluster]]:
    with ExitStack() as stack:
        result = {}
        for cluster_id in ("a", "b"):
            work = tmp_path_factory.mktemp(f"auth-{cluster_id}")
            auth = stack.enter_context(running_auth(auth_settings(work, cluster_id)))
            with AuthClient(auth.address) as client:
                admin = client.login("admin", ADMIN_PASSWORD).token
                tokens = {}
                for name in ACCOUNTS:
                    client.create_account(admin, name, PASSWORD)
                    tokens[name] = client.login(name, PASSWORD).token
            result[cluster_id] = Cluster(auth, tokens)
        yield result


def switch_settings(
    work: Path, pki: PkiLayout, cluster_id: str, peer: str, auth: str, **overrides: Any
) -> SwitchSettings:
    paths = pki.cluster(cluster_id)
    fields: dict[str, Any] = {
        "cluster_id": cluster_id,
        "peer_cluster_id": peer,
        "tls_cert": paths.switch_cert,
        "tls_key": paths.switch_key,
        "trust_bundle": paths.trust_bundle,
        "auth_address": auth,
        "data_dir": work / f"switch-{cluster_id}",
        "metrics_port": -1,
    }
    return SwitchSettings(**(fields | overrides))


class Pair:
    def __init__(self, a: SwitchThread, b: SwitchThread) -> None:
        self.a, self.b = a, b
        self.switches = {"a": a, "b": b}

    def audit(self, cluster_id: str, event: str) -> list[dict[str, Any]]:
        """The switch's audit records of ``event`` so far (a line still being written is left out)."""
        path = self.switches[cluster_id].running.audit.path
        lines = Path(path).read_text().splitlines(keepends=True)
        records = [json.loads(line) for line in lines if line.endswith("\n") and line.strip()]
        return [r for r in records if r["event"] == event]


@contextmanager
def switch_pair(
    tmp_path: Path,
    pki: PkiLayout,
    clusters: dict[str, Cluster],
    shape: LinkShape | None = None,
    a_overrides: dict[str, Any] | None = None,
    front: Callable[[int], int] | None = None,
    **overrides: Any,
) -> Iterator[Pair]:
    """Switch b accepting, switch a dialing it (through a WAN emulator of ``shape`` if given).

    ``overrides`` are settings of both switches; ``a_overrides`` replace some of them for switch a only;
    ``front``, given b's WAN port once b is up, returns the port a dials instead (a test's own proxy,
    which the test stops after the pair).
    """
    b = SwitchThread(
        switch_settings(tmp_path, pki, "b", "a", clusters["b"].auth.address, link_role="accept", **overrides)
    )
    emulator = None
    try:
        wan_port = b.running.wan_port
        if shape is not None:
            emulator = WanEmulator("127.0.0.1", wan_port, shape)
            wan_port = asyncio.run_coroutine_threadsafe(emulator.start(), b._loop).result(10)
        if front is not None:
            wan_port = front(wan_port)
        a = SwitchThread(
            switch_settings(
                tmp_path,
                pki,
                "a",
                "b",
                clusters["a"].auth.address,
                link_role="dial",
                peer_address=f"127.0.0.1:{wan_port}",
                **{**overrides, **(a_overrides or {})},
            )
        )
        try:
            wait_for(lambda: a.running.link.connected and b.running.link.connected, 30, "the link to come up")
            yield Pair(a, b)
        finally:
            a.stop()
    finally:
        if emulator is not None:
            asyncio.run_coroutine_threadsafe(emulator.stop(), b._loop).result(10)
        b.stop()


def _to_wire(message: relay_pb2.EdgeMessage | bytes) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def _from_wire(raw: bytes) -> relay_pb2.EdgeMessage | bytes:
    """Framed chunks stay the bytes they arrived as (so tests can compare them); the rest is parsed."""
    return raw if is_framed(raw) else relay_pb2.EdgeMessage.FromString(raw)


class EdgeClient:
    """A raw Relay.OpenEdge client standing in for a trainer; ``read=False`` never reads its stream.

    It opens with ``link_framing`` (``LINK_FRAMING_VERSION`` unless a test says otherwise) and may send
    framed chunks (bytes); framed chunks it receives are kept as bytes.
    """

    def __init__(
        self,
        switch: SwitchThread,
        token: str,
        job_id: str,
        edge: str = "e",
        *,
        reconnect: bool = False,
        read: bool = True,
        epoch: int = 0,
        link_framing: int = LINK_FRAMING_VERSION,
    ) -> None:
        self._out: queue.Queue[relay_pb2.EdgeMessage | bytes | None] = queue.Queue()
        self.inbox: queue.Queue[tuple[relay_pb2.EdgeMessage | BaseException | None, float]] = queue.Queue()
        self.received: list[tuple[relay_pb2.EdgeMessage, float]] = []
        self._channel = grpc.insecure_channel(switch.internal_address)
        self._out.put(
            relay_pb2.EdgeMessage(
                open=relay_pb2.EdgeOpen(
                    job_id=job_id,
                    edge=edge,
                    reconnect=reconnect,
                    epoch=epoch,
                    link_framing=link_framing,
                )
            )
        )
        open_edge = self._channel.stream_stream(
            "/nebula.v1.Relay/OpenEdge", request_serializer=_to_wire, response_deserializer=_from_wire
        )
        self.call = open_edge(self._requests(), metadata=bearer_metadata(token))
        self.ended: BaseException | None = None
        self.done = threading.Event()
        if read:
            threading.Thread(target=self._read, daemon=True).start()

    def _requests(self) -> Iterator[relay_pb2.EdgeMessage | bytes]:
        while (message := self._out.get()) is not None:
            yield message

    def _read(self) -> None:
        try:
            for message in self.call:
                self.inbox.put((message, time.monotonic()))
            self.inbox.put((None, time.monotonic()))
        except BaseException as exc:  # handed to the test
            self.inbox.put((exc, time.monotonic()))
        finally:
            self.done.set()

    def send(self, message: relay_pb2.EdgeMessage | bytes) -> None:
        self._out.put(message)

    def next(self, timeout: float, what: str) -> relay_pb2.EdgeMessage | BaseException | None:
        try:
            message, at = self.inbox.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}") from None
        if isinstance(message, relay_pb2.EdgeMessage):
            self.received.append((message, at))
        return message  # type: ignore[return-value]  # a framed chunk stays bytes

    def expect_framed(self, timeout: float = 20.0) -> bytes:
        """The next message, which must be a framed chunk (acks are passed over)."""
        while True:
            message = self.next(timeout, "a framed chunk")
            if isinstance(message, relay_pb2.EdgeMessage) and message.WhichOneof("body") == "ack":
                continue
            assert isinstance(message, bytes), f"wanted a framed chunk, got {message!r}"
            return message

    def expect(self, kind: str, timeout: float = 20.0, skip: tuple[str, ...] = ()) -> relay_pb2.EdgeMessage:
        """The next message, which must be ``kind`` (messages of kinds in ``skip`` are passed over)."""
        while True:
            message = self.next(timeout, kind)
            assert isinstance(message, relay_pb2.EdgeMessage), f"wanted {kind}, the stream ended: {message!r}"
            if message.WhichOneof("body") in skip:
                continue
            assert message.WhichOneof("body") == kind, f"wanted {kind}, got {message}"
            return message

    def crash(self) -> None:
        """Vanish without a close and without ending the request stream (a killed trainer)."""
        self.call.cancel()
        self._channel.close()

    def finish(self) -> None:
        self._out.put(None)
        self.call.cancel()
        self._channel.close()


def frame(frame_id: int, payload: int = 0) -> relay_pb2.EdgeMessage:
    if payload:
        return relay_pb2.EdgeMessage(
            frame=tensor_pb2.TensorFrame(chunk=tensor_pb2.TensorChunk(frame_id=frame_id, data=b"x" * payload))
        )
    return relay_pb2.EdgeMessage(
        frame=tensor_pb2.TensorFrame(header=tensor_pb2.TensorHeader(frame_id=frame_id, codec="none"))
    )


def ack(resume: bool = True) -> relay_pb2.EdgeMessage:
    return relay_pb2.EdgeMessage(
        ack=relay_pb2.EdgeAck(direction=1, received=0, max_bytes=1 << 20, resume=resume)
    )


@contextmanager
def edge_pair(
    pair: Pair, clusters: dict[str, Cluster], account: str, job_id: str
) -> Iterator[tuple[EdgeClient, EdgeClient]]:
    """Both ends of one edge, opened and ready, speaking edge protocol 2 (each sent an ack)."""
    ends = (
        EdgeClient(pair.a, clusters["a"].tokens[account], job_id),
        EdgeClient(pair.b, clusters["b"].tokens[account], job_id),
    )
    try:
        for end in ends:
            ready = end.expect("ready").ready
            assert ready.link_up and ready.peer_cluster in ("a", "b") and ready.max_window_bytes > 0
            end.send(ack())
        for end in ends:
            end.expect("ack")
        yield ends
    finally:
        for end in ends:
            end.finish()


class Stream:
    """Sends header frames ``every`` seconds from one end, timing each one's arrival at the other."""

    def __init__(self, sender: EdgeClient, receiver: EdgeClient, every: float = 0.01) -> None:
        self.sent: dict[int, float] = {}
        self.arrived: dict[int, float] = {}
        self._sender, self._receiver, self._every = sender, receiver, every
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._send, daemon=True),
            threading.Thread(target=self._receive, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _send(self) -> None:
        frame_id = 0
        while not self._stop.is_set():
            frame_id += 1
            self.sent[frame_id] = time.monotonic()
            self._sender.send(frame(frame_id))
            self._stop.wait(self._every)

    def _receive(self) -> None:
        while True:
            try:
                message = self._receiver.next(60, "a frame")
            except AssertionError:
                return
            if not isinstance(message, relay_pb2.EdgeMessage):
                return
            if message.WhichOneof("body") == "frame":
                self.arrived[message.frame.header.frame_id] = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        last = max(self.sent)
        wait_for(lambda: last in self.arrived, 30, f"frame {last} of the healthy route")

    def arrivals_between(self, start: float, end: float) -> int:
        return sum(1 for at in self.arrived.values() if start <= at <= end)

    def worst_latency(self) -> float:
        missing = set(self.sent) - set(self.arrived)
        assert not missing, f"frames lost on the healthy route: {sorted(missing)[:10]}"
        return max(self.arrived[i] - self.sent[i] for i in self.sent)


def test_a_flooding_route_is_closed_and_audited_while_a_healthy_route_keeps_moving(
    tmp_path: Path, pki_ab: PkiLayout, clusters: dict[str, Cluster]
) -> None:
    with (
        switch_pair(tmp_path, pki_ab, clusters) as pair,
        edge_pair(pair, clusters, "alice", "healthy") as (ha, hb),
    ):
        healthy = Stream(ha, hb)
        wait_for(lambda: len(healthy.arrived) >= 20, 20, "the healthy route to move")
        flooder = EdgeClient(pair.a, clusters["a"].tokens["mallory"], "flood")
        flooder.expect("ready")
        flood_started = time.monotonic()
        for frame_id in range(1, 5001):  # header-only frames for a job nobody in b receives
            flooder.send(frame(frame_id))
        close = flooder.expect("close", timeout=60).close
        flood_closed = time.monotonic()
        assert close.error and "switch 'b'" in close.reason and "unattached_items" in close.reason, (
            close.reason
        )
        assert "4096" in close.reason and "4097" in close.reason
        after = len(healthy.arrived)
        wait_for(
            lambda: len(healthy.arrived) >= after + 20, 20, "the healthy route to keep moving after the flood"
        )
        healthy.stop()
        assert healthy.worst_latency() < 5.0, healthy.worst_latency()
        if flood_closed - flood_started > 0.5:
            assert healthy.arrivals_between(flood_started, flood_closed) > 0, "the healthy route stalled"
        records = [r for r in pair.audit("b", "route.closed") if r["job_id"] == "flood"]
        assert records and records[0]["outcome"] == "refused", records
        assert records[0]["details"]["edge"] == "e" and "unattached_items" in records[0]["details"]["reason"]
        flooder.finish()
        # Switch b cannot know the account of a route nobody attached; switch a's record names both.
        closes = wait_for(
            lambda: [r for r in pair.audit("a", "edge.close") if r["job_id"] == "flood"],
            20,
            "switch a's edge.close record of the flooding route",
        )
        assert closes[0]["account"] == "mallory" and closes[0]["outcome"] == "failure", closes
        assert closes[0]["details"]["closed_by"] == "peer", closes
        assert "unattached_items" in closes[0]["details"]["reason"], closes


def _sample(name: str, account: str) -> float:
    return REGISTRY.get_sample_value(name, {"account": account}) or 0.0


def test_an_account_above_its_item_rate_is_paced_without_slowing_another(
    tmp_path: Path, pki_ab: PkiLayout, clusters: dict[str, Cluster]
) -> None:
    rate, burst = 300.0, 100
    with (
        switch_pair(tmp_path, pki_ab, clusters, account_item_rate=rate, account_item_burst=burst) as pair,
        edge_pair(pair, clusters, "alice", "steady") as (ha, hb),
    ):
        healthy = Stream(ha, hb)  # 100 items a second, under the rate: never paced
        wait_for(lambda: len(healthy.arrived) >= 20, 20, "the healthy route to move")
        read_before = _sample("nebula_switch_items_read_total", "mallory")
        paced_before = _sample("nebula_switch_throttled_seconds_total", "mallory")
        alice_paced = _sample("nebula_switch_throttled_seconds_total", "alice")
        flooder = EdgeClient(pair.a, clusters["a"].tokens["mallory"], "paced")
        flooder.expect("ready")
        started = time.monotonic()
        for frame_id in range(1, 3001):  # all at once; fewer than the peer's unattached bound
            flooder.send(frame(frame_id))
        wait_for(
            lambda: _sample("nebula_switch_items_read_total", "mallory") - read_before >= 600, 20, "reads"
        )
        elapsed = time.monotonic() - started
        read = _sample("nebula_switch_items_read_total", "mallory") - read_before
        # Read at the account's rate (plus its burst), not as fast as gRPC delivers them.
        assert read <= burst + rate * (elapsed + PAUSE_S) + 5, (read, elapsed)
        assert elapsed >= (600 - burst) / rate * 0.9, elapsed
        # Paced, unless delivery itself never outran the cap (a busy machine can deliver slower than
        # 300 items/s, and then the bucket never runs dry): either way it never read above the rate.
        paced = _sample("nebula_switch_throttled_seconds_total", "mallory") - paced_before
        delivered_rate = (read - burst) / elapsed
        assert paced > 0 or delivered_rate <= rate, (paced, read, elapsed, delivered_rate)
        assert flooder.inbox.empty(), "the paced stream was closed or answered"  # paced, never closed
        after = len(healthy.arrived)
        wait_for(lambda: len(healthy.arrived) >= after + 50, 20, "the healthy route to keep moving")
        healthy.stop()
        assert healthy.worst_latency() < 1.0, healthy.worst_latency()
        assert _sample("nebula_switch_throttled_seconds_total", "alice") == alice_paced
        flooder.finish()


def test_a_receiver_that_never_reads_is_closed_without_delaying_another_route(
    tmp_path: Path, pki_ab: PkiLayout, clusters: dict[str, Cluster]
) -> None:
    with (
        # The bound under test is the receiving switch's: the sending switch's own (which a burst of
        # this credit-ignoring client could trip first) is set far above the 30 MiB sent.
        switch_pair(
            tmp_path, pki_ab, clusters, max_window_bytes=1 << 20, a_overrides={"max_window_bytes": 64 << 20}
        ) as pair,
        edge_pair(pair, clusters, "alice", "healthy") as (ha, hb),
    ):
        healthy = Stream(ha, hb)
        slow_receiver = EdgeClient(pair.b, clusters["b"].tokens["bob"], "slow", read=False)
        sender = EdgeClient(pair.a, clusters["a"].tokens["bob"], "slow")
        sender.expect("ready")
        wait_for(
            lambda: pair.b.running.router.get(("slow", "e")) is not None, 20, "the slow receiver to attach"
        )
        started = time.monotonic()
        for chunk_id in range(1, 121):  # 30 MiB toward a receiver that reads nothing
            sender.send(frame(chunk_id, payload=256 * 1024))
        close = sender.expect("close", timeout=60).close
        assert close.error and "switch 'b'" in close.reason and "bound window" in close.reason, close.reason
        closed = time.monotonic()
        after = len(healthy.arrived)
        wait_for(lambda: len(healthy.arrived) >= after + 20, 20, "the healthy route to keep moving")
        healthy.stop()
        assert healthy.worst_latency() < 5.0, healthy.worst_latency()
        if closed - started > 0.5:
            assert healthy.arrivals_between(started, closed) > 0, "the healthy route stalled"
        assert [r for r in pair.audit("b", "route.closed") if r["job_id"] == "slow" and r["account"] == "bob"]
        slow_receiver.finish()
        sender.finish()


def test_a_small_item_of_one_job_is_not_queued_behind_a_large_tensor_of_another(
    tmp_path: Path, pki_ab: PkiLayout, clusters: dict[str, Cluster]
) -> None:
    shape = LinkShape(bandwidth_mbit=40.0, delay_ms=5.0)  # 15 MiB take about 3 s
    with switch_pair(tmp_path, pki_ab, clusters, shape=shape) as pair:
        ends = {}
        for account, job in (("alice", "big"), ("bob", "small")):
            ends[job] = (
                EdgeClient(pair.a, clusters["a"].tokens[account], job),
                EdgeClient(pair.b, clusters["b"].tokens[account], job),
            )
            for end in ends[job]:
                end.expect("ready")
        big_sender, big_receiver = ends["big"]
        small_sender, small_receiver = ends["small"]
        for chunk_id in range(1, 61):
            big_sender.send(frame(chunk_id, payload=256 * 1024))
        wait_for(
            lambda: pair.a.running.router.buffered_out > 2 << 20, 20, "the large tensor to queue at switch a"
        )
        sent = time.monotonic()
        for frame_id in (1001, 1002, 1003):
            small_sender.send(frame(frame_id))
        for _ in range(3):
            small_receiver.expect("frame", timeout=30)
        chunks = [big_receiver.expect("frame", timeout=60).frame.chunk.frame_id for _ in range(60)]
        assert chunks == list(range(1, 61))  # in order within the route
        small_last = small_receiver.received[-1][1]  # arrival times, taken by the reader threads
        big_last = big_receiver.received[-1][1]
        # First in, first out, the small frames would arrive with the last chunk. Measured on an idle
        # machine: 0.35 s after sending with the default 1 MiB link window (1.0 s with gRPC's
        # BDP-probed window), the tensor's last chunk 3.2 s.
        assert small_last < big_last - 1.0, (small_last - sent, big_last - sent)
        for pair_ends in ends.values():
            for end in pair_ends:
                end.finish()


def test_a_link_session_that_ends_notifies_attached_routes_which_stay_attached(
    tmp_path: Path, pki_ab: PkiLayout, clusters: dict[str, Cluster]
) -> None:
    with (
        switch_pair(tmp_path, pki_ab, clusters) as pair,
        edge_pair(pair, clusters, "carol", "cut") as (ca, cb),
    ):
        sessions = pair.a.running.link.state.sessions
        link = pair.a.running.link
        pair.a._loop.call_soon_threadsafe(lambda: link._close_session.set())
        for end in (ca, cb):
            down = end.expect("notice", timeout=30).notice
            assert not down.up and down.reason, down
            up = end.expect("notice", timeout=30).notice
            assert up.up, up
        assert pair.a.running.link.state.sessions == sessions + 1
        for end in (ca, cb):
            end.send(ack())
        ca.send(frame(1))
        cb.send(frame(1))
        assert cb.expect("frame", skip=("ack",)).frame.header.frame_id == 1
        assert ca.expect("frame", skip=("ack",)).frame.header.frame_id == 1
        assert pair.a.running.router.get(("cut", "e")) is not None


def test_reconnect_takes_the_route_over_and_a_crash_orphans_the_route_until_a_reconnect(
    tmp_path: Path, pki_ab: PkiLayout, clusters: dict[str, Cluster]
) -> None:
    with (
        switch_pair(tmp_path, pki_ab, clusters) as pair,
        edge_pair(pair, clusters, "dave", "takeover") as (da, db),
    ):
        second = EdgeClient(pair.b, clusters["b"].tokens["dave"], "takeover")
        refused = second.next(20, "the refusal")
        assert isinstance(refused, grpc.RpcError) and refused.code() == grpc.StatusCode.ALREADY_EXISTS
        other = EdgeClient(pair.b, clusters["b"].tokens["bob"], "takeover", reconnect=True)
        refused = other.next(20, "the refusal")
        assert isinstance(refused, grpc.RpcError) and refused.code() == grpc.StatusCode.ALREADY_EXISTS
        takeover = EdgeClient(pair.b, clusters["b"].tokens["dave"], "takeover", reconnect=True)
        takeover.expect("ready")
        assert db.next(20, "the end of the superseded stream") is None  # ended quietly, status OK
        da.send(frame(7))
        assert takeover.expect("frame").frame.header.frame_id == 7
        takeover.send(frame(3))
        assert da.expect("frame").frame.header.frame_id == 3  # the peer saw no close
        takeover.crash()
        # The vanished stream orphans its route (relay.proto, "A vanished trainer"): the peer hears
        # nothing, and a reconnect of the same account continues the edge.
        route = pair.b.running.router.get(("takeover", "e"))
        wait_for(lambda: route is not None and route.detached == "orphaned", 20, "the route to be orphaned")
        again = EdgeClient(pair.b, clusters["b"].tokens["dave"], "takeover", reconnect=True)
        again.expect("ready")
        da.send(frame(8))
        assert again.expect("frame").frame.header.frame_id == 8
        again.send(frame(4))
        assert da.expect("frame").frame.header.frame_id == 4  # still no close before it
        for end in (second, other, again):
            end.finish()


def test_the_routes_of_one_account_are_limited(
    tmp_path: Path, pki_ab: PkiLayout, clusters: dict[str, Cluster]
) -> None:
    with switch_pair(tmp_path, pki_ab, clusters, max_routes_per_account=2) as pair:
        token = clusters["a"].tokens["dave"]
        opened = [EdgeClient(pair.a, token, f"job-{i}") for i in range(2)]
        for end in opened:
            end.expect("ready")
        third = EdgeClient(pair.a, token, "job-2")
        refused = third.next(20, "the refusal")
        assert isinstance(refused, grpc.RpcError) and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_routes_per_account = 2" in (refused.details() or "")
        other_account = EdgeClient(pair.a, clusters["a"].tokens["carol"], "job-3")
        other_account.expect("ready")
        records = [
            r for r in pair.audit("a", "edge.open") if r["outcome"] == "refused" and r["account"] == "dave"
        ]
        assert records and "max_routes_per_account" in records[0]["details"]["reason"]
        for end in (*opened, third, other_account):
            end.finish()


def test_a_route_nobody_attaches_to_times_out(
    tmp_path: Path, pki_ab: PkiLayout, clusters: dict[str, Cluster]
) -> None:
    with switch_pair(tmp_path, pki_ab, clusters, unattached_timeout_s=1.0) as pair:
        lonely = EdgeClient(pair.a, clusters["a"].tokens["carol"], "lonely")
        lonely.expect("ready")
        started = time.monotonic()
        lonely.send(frame(1))
        close = lonely.expect("close", timeout=20).close
        assert close.error and "unattached_timeout" in close.reason and "switch 'b'" in close.reason, (
            close.reason
        )
        assert time.monotonic() - started >= 0.9
        wait_for(
            lambda: [r for r in pair.audit("b", "route.closed") if r["job_id"] == "lonely"],
            10,
            "the audit record",
        )
        lonely.finish()


def test_a_trainer_sending_beyond_its_credit_while_the_link_is_down_is_closed(
    tmp_path: Path, pki_ab: PkiLayout, clusters: dict[str, Cluster]
) -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    switch = SwitchThread(
        switch_settings(
            tmp_path,
            pki_ab,
            "a",
            "b",
            clusters["a"].auth.address,
            link_role="dial",
            peer_address=f"127.0.0.1:{port}",
            max_window_bytes=65536,
        )
    )
    try:
        cheater = EdgeClient(switch, clusters["a"].tokens["mallory"], "cheat")
        ready = cheater.expect("ready", timeout=20).ready  # at once, although no link is up
        assert not ready.link_up and ready.max_window_bytes == 65536
        cheater.send(ack())
        for chunk_id in range(1, 16):
            cheater.send(frame(chunk_id, payload=16 * 1024))
        close = cheater.expect("close", timeout=20).close
        assert close.error and "bound credit" in close.reason and "switch 'a'" in close.reason, close.reason
        cheater.finish()
    finally:
        switch.stop()


def test_the_wan_port_drops_a_client_that_never_completes_tls(
    tmp_path: Path, pki_ab: PkiLayout, clusters: dict[str, Cluster]
) -> None:
    assert SwitchSettings.model_fields["wan_handshake_timeout_s"].default == 10.0
    switch = SwitchThread(
        switch_settings(
            tmp_path,
            pki_ab,
            "b",
            "a",
            clusters["b"].auth.address,
            link_role="accept",
            wan_handshake_timeout_s=2.0,
        )
    )
    try:
        with socket.create_connection(("127.0.0.1", switch.running.wan_port), timeout=30) as idle:
            started = time.monotonic()
            assert idle.recv(1024) == b""  # closed by the server; a timeout here raises instead
            elapsed = time.monotonic() - started
        assert 1.5 <= elapsed <= 8.0, elapsed
    finally:
        switch.stop()


def resume(seq: int = 1, steps: tuple[float, ...] = ()) -> relay_pb2.EdgeMessage:
    """The first item of a direction in a new epoch (relay.proto, SIGNAL_KIND_RESUME)."""
    return relay_pb2.EdgeMessage(
        signal=relay_pb2.EdgeSignal(
            seq=seq, direction=1, kind=relay_pb2.SIGNAL_KIND_RESUME, step=1, values=list(steps)
        )
    )


def stale_items() -> float:
    return REGISTRY.get_sample_value("nebula_switch_stale_items_total") or 0.0


def test_a_restarted_trainer_rejoins_at_a_higher_epoch_and_its_peer_restarts_without_a_close(
    tmp_path: Path, pki_ab: PkiLayout, clusters: dict[str, Cluster]
) -> None:
    with (
        switch_pair(tmp_path, pki_ab, clusters) as pair,
        edge_pair(pair, clusters, "carol", "rejoin") as (old_a, old_b),
    ):
        account = "carol"
        old_a.send(frame(1))
        assert old_b.expect("frame").frame.header.frame_id == 1
        old_a.crash()  # trainer a is killed: no close
        route_a = pair.a.running.router.get(("rejoin", "e"))
        wait_for(
            lambda: route_a is not None and route_a.detached == "orphaned", 20, "a's route to be orphaned"
        )
        # The restarted trainer a opens epoch 1 (before it sends anything, the peer is still at 0).
        new_a = EdgeClient(pair.a, clusters["a"].tokens[account], "rejoin", epoch=1)
        assert new_a.expect("ready").ready.epoch == 1
        # b's old stream sends epoch-0 items that reach a after a moved on: dropped and counted.
        before = stale_items()
        old_b.send(frame(99))
        old_b.send(ack())
        wait_for(lambda: stale_items() >= before + 2, 20, "switch a to drop b's late epoch-0 items")
        new_a.send(resume(steps=(10.0, 20.0)))
        new_a.send(ack())
        # The peer was never sent a close: its first news is the restart, naming cluster a's stage.
        restart = old_b.expect("restart", skip=("ack",)).restart
        assert restart.epoch == 1 and "cluster 'a'" in restart.reason, restart
        assert old_b.next(20, "the end of b's old stream") is None  # the switch ended it, status OK
        # A stream opened below the route's epoch is void from the start.
        stale = EdgeClient(pair.b, clusters["b"].tokens[account], "rejoin", reconnect=True)
        assert stale.expect("ready").ready.epoch == 1
        assert stale.expect("restart").restart.epoch == 1
        assert stale.next(20, "the end of the stale stream") is None
        opened = [r for r in pair.audit("b", "edge.open") if r["job_id"] == "rejoin"]
        assert [r["details"].get("route_epoch") for r in opened if r["outcome"] == "refused"] == [1], opened
        # b reopens at epoch 1: a's RESUME waited for it; then items flow both ways.
        new_b = EdgeClient(pair.b, clusters["b"].tokens[account], "rejoin", epoch=1)
        assert new_b.expect("ready").ready.epoch == 1
        got = new_b.expect("signal", skip=("ack",)).signal
        assert got.kind == relay_pb2.SIGNAL_KIND_RESUME and list(got.values) == [10.0, 20.0]
        new_b.send(resume(steps=(20.0,)))
        new_b.send(ack())
        got = new_a.expect("signal", skip=("ack",)).signal
        assert got.kind == relay_pb2.SIGNAL_KIND_RESUME and list(got.values) == [20.0]
        new_a.send(frame(2))
        assert new_b.expect("frame", skip=("ack",)).frame.header.frame_id == 2
        new_b.send(frame(2))
        assert new_a.expect("frame", skip=("ack",)).frame.header.frame_id == 2
        # Nothing of epoch 0 reached the new streams.
        for end in (new_a, new_b):
            kinds = [m.WhichOneof("body") for m, _ in end.received]
            assert "close" not in kinds and "restart" not in kinds, kinds
        assert [m.frame.header.frame_id for m, _ in new_a.received if m.WhichOneof("body") == "frame"] == [2]
        for end in (new_a, new_b, stale):
            end.finish()


def test_an_orphaned_route_nobody_reattaches_is_closed_to_the_peer_and_audited(
    tmp_path: Path, pki_ab: PkiLayout, clusters: dict[str, Cluster]
) -> None:
    with (
        switch_pair(tmp_path, pki_ab, clusters, orphan_timeout_s=1.0) as pair,
        edge_pair(pair, clusters, "bob", "gone") as (ga, gb),
    ):
        closed_before = (
            REGISTRY.get_sample_value("nebula_switch_routes_closed_total", {"reason": "orphan_timeout"})
            or 0.0
        )
        ga.crash()
        crashed = time.monotonic()
        close = gb.expect("close", timeout=30, skip=("ack",)).close
        assert time.monotonic() - crashed >= 0.9  # not at once: after the orphan timeout
        assert close.error and "cluster 'a'" in close.reason and "1 s" in close.reason, close.reason
        assert "orphan_timeout" in close.reason, close.reason
        records = wait_for(
            lambda: [r for r in pair.audit("a", "route.closed") if r["job_id"] == "gone"],
            10,
            "the audit record",
        )
        assert records[0]["account"] == "bob" and records[0]["details"]["bound"] == "orphan_timeout"
        ended = [r for r in pair.audit("a", "edge.close") if r["job_id"] == "gone"]
        assert ended and ended[0]["outcome"] == "failure" and ended[0]["details"]["orphaned"] is True, ended
        assert (
            REGISTRY.get_sample_value("nebula_switch_routes_closed_total", {"reason": "orphan_timeout"})
            == closed_before + 1
        )


def _refused(client: EdgeClient) -> grpc.RpcError:
    ended = client.next(20, "the refusal of an edge in a penalty backoff")
    assert isinstance(ended, grpc.RpcError), f"wanted a refusal, got {ended!r}"
    return ended


@pytest.mark.faults  # a flooding edge, closed and refused (`make test-faults`)
def test_a_flooder_is_closed_then_refused_while_other_edges_keep_working(
    tmp_path: Path, pki_ab: PkiLayout, clusters: dict[str, Cluster]
) -> None:
    """The flooder's account backs off (RESOURCE_EXHAUSTED naming the penalty, audited once); alice's
    edge and mallory's own running job are never refused and keep moving."""
    backoff = 6.0
    with (
        switch_pair(
            tmp_path, pki_ab, clusters, penalty_backoff_min_s=backoff, penalty_backoff_max_s=30.0
        ) as pair,
        edge_pair(pair, clusters, "alice", "healthy") as (ha, hb),
        edge_pair(pair, clusters, "mallory", "mallory-good") as (ma, mb),
    ):
        healthy, own = Stream(ha, hb), Stream(ma, mb)
        wait_for(lambda: len(healthy.arrived) >= 10 and len(own.arrived) >= 10, 20, "both routes to move")
        flooder = EdgeClient(pair.a, clusters["a"].tokens["mallory"], "flood-1")
        flooder.expect("ready")
        for frame_id in range(1, UNATTACHED_MAX_ITEMS + 100):
            flooder.send(frame(frame_id))
        close = flooder.expect("close", timeout=60).close
        assert close.error and "unattached_items" in close.reason, close.reason
        flooder.finish()
        penalty = wait_for(
            lambda: [r for r in pair.audit("a", "account.penalty") if r["job_id"] == "flood-1"],
            20,
            "switch a's account.penalty record",
        )[0]
        assert penalty["account"] == "mallory" and penalty["details"]["bound"] == "unattached_items", penalty
        assert penalty["details"]["backoff_s"] == backoff and penalty["details"]["closed_by"] == "peer"
        # Re-opening the penalized job (its route may be kept orphaned here) or new job ids (as the
        # flooder does) is refused, naming the penalty.
        refusals = []
        for job in ("flood-1", "flood-2", "flood-3"):
            again = EdgeClient(pair.a, clusters["a"].tokens["mallory"], job)
            refusals.append(_refused(again))
            again.finish()
        for refusal in refusals:
            assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refusal
            assert "penalty backoff" in refusal.details() and "'mallory'" in refusal.details(), (
                refusal.details()
            )
        records = [
            r
            for r in pair.audit("a", "edge.open")
            if r["account"] == "mallory" and r["details"].get("penalty") == "backoff"
        ]
        assert len(records) == 1, records  # audited once per backoff, not once per refused call
        assert REGISTRY.get_sample_value("nebula_switch_penalty_refusals_total", {"account": "mallory"}) >= 3
        # Another account opens new edges as usual, and mallory's running job re-attaches (a reconnect).
        other = EdgeClient(pair.a, clusters["a"].tokens["alice"], "alice-new")
        other.expect("ready")
        other.finish()
        mine = len(own.arrived)
        wait_for(lambda: len(own.arrived) >= mine + 10, 20, "mallory's running job to keep moving")
        ma.crash()
        back = EdgeClient(pair.a, clusters["a"].tokens["mallory"], "mallory-good", reconnect=True)
        back.expect("ready")
        back.finish()
        # Alice's route never stalled; after the backoff mallory may open new edges again.
        after = len(healthy.arrived)
        wait_for(lambda: len(healthy.arrived) >= after + 10, 20, "alice's route to keep moving")
        healthy.stop()
        assert healthy.worst_latency() < 5.0, healthy.worst_latency()

        def opens_again() -> bool:
            client = EdgeClient(pair.a, clusters["a"].tokens["mallory"], f"later-{time.monotonic()}")
            try:
                message = client.next(20, "ready or a refusal")
                return isinstance(message, relay_pb2.EdgeMessage) and message.WhichOneof("body") == "ready"
            finally:
                client.finish()

        wait_for(opens_again, backoff + 20, "mallory's backoff to end")


def test_framed_chunks_cross_both_switches_byte_for_byte(
    tmp_path: Path, pki_ab: PkiLayout, clusters: dict[str, Cluster]
) -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB
    with switch_pair(tmp_path, pki_ab, clusters) as pair:
        token_a, token_b = clusters["a"].tokens["alice"], clusters["b"].tokens["alice"]
        sender = EdgeClient(pair.a, token_a, "framed")
        receiver = EdgeClient(pair.b, token_b, "framed")
        for end in (sender, receiver):
            assert end.expect("ready").ready.link_framing == LINK_FRAMING_VERSION
        raw, _ = encode_chunk("framed", "e", 0, 1, 0, payload, True)
        sender.send(frame(1))
        sender.send(raw)
        receiver.expect("frame")
        assert receiver.expect_framed() == raw  # the very bytes the sender built
        sent = pair.a.running.link.sent
        # Switch a counts a chunk once its write returns, which can be after b already delivered it.
        wait_for(lambda: sent.payload_bytes >= len(payload), 10, "switch a to count the chunk sent")
        assert sent.payload_bytes == len(payload)
        for end in (sender, receiver):
            end.finish()


def test_an_edge_opened_without_link_framing_is_refused_naming_the_field_and_audited(
    tmp_path: Path, pki_ab: PkiLayout, clusters: dict[str, Cluster]
) -> None:
    with switch_pair(tmp_path, pki_ab, clusters) as pair:
        client = EdgeClient(pair.a, clusters["a"].tokens["alice"], "unframed", link_framing=0)
        ended = client.next(20, "the refusal")
        assert isinstance(ended, grpc.RpcError), ended
        assert ended.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "EdgeOpen.link_framing 0 is not supported: it must be 1" in (ended.details() or "")
        refused = [r for r in pair.audit("a", "edge.open") if r["job_id"] == "unframed"]
        assert [(r["outcome"], r["account"], r["details"]["link_framing"]) for r in refused] == [
            ("refused", "alice", 0)
        ]
        assert pair.a.running.router.get(("unframed", "e")) is None  # no route was made for it
        client.finish()


def test_a_link_handshake_without_link_framing_is_refused_and_audited(
    tmp_path: Path, pki_ab: PkiLayout, clusters: dict[str, Cluster]
) -> None:
    """Switch a's own certificate, so only the handshake's ``link_framing`` is wrong."""
    paths = pki_ab.cluster("a")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=paths.trust_bundle.read_bytes(),
        private_key=paths.switch_key.read_bytes(),
        certificate_chain=paths.switch_cert.read_bytes(),
    )
    hello = link_pb2.Handshake(protocol_version=PROTOCOL_VERSION, cluster_id="a", link_framing=0)
    with switch_pair(tmp_path, pki_ab, clusters) as pair:
        sessions = pair.b.running.link.state.sessions
        with grpc.secure_channel(
            f"127.0.0.1:{pair.b.running.wan_port}",
            credentials,
            options=channel_options(Identity("b", "switch")),
        ) as channel:
            call = link_pb2_grpc.SwitchLinkStub(channel).Link(
                iter([link_pb2.LinkMessage(hello=hello)]), timeout=10
            )
            with pytest.raises(grpc.RpcError) as refused:
                for _ in call:
                    pass
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        reason = "peer's Handshake.link_framing 0 is not supported: it must be 1"
        assert reason in (refused.value.details() or "")
        records = [r["details"] for r in pair.audit("b", "link.refused")]
        assert [d["layer"] for d in records if reason in d["reason"]] == ["handshake"], records
        assert pair.b.running.link.state.sessions == sessions  # the live session was not touched
        assert pair.a.running.link.connected and pair.b.running.link.connected


@pytest.mark.parametrize(
    ("job", "edge", "epoch"), [("another-job", "e", 0), ("tagged", "other-edge", 0), ("tagged", "e", 1)]
)
def test_a_framed_chunk_tagged_for_another_route_or_epoch_is_refused_and_audited(
    tmp_path: Path, pki_ab: PkiLayout, clusters: dict[str, Cluster], job: str, edge: str, epoch: int
) -> None:
    with switch_pair(tmp_path, pki_ab, clusters) as pair:
        sender = EdgeClient(pair.a, clusters["a"].tokens["alice"], "tagged")
        receiver = EdgeClient(pair.b, clusters["b"].tokens["alice"], "tagged")
        for end in (sender, receiver):
            end.expect("ready")
        sender.send(encode_chunk(job, edge, epoch, 1, 0, b"payload", True)[0])
        ended = sender.next(20, "the refusal")
        assert isinstance(ended, grpc.RpcError), ended
        assert ended.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"tagged job {job!r} edge {edge!r} epoch {epoch}" in (ended.details() or "")
        close = receiver.expect("close", skip=("notice",)).close
        assert close.error and "framed chunk tagged" in close.reason
        refused = pair.audit("a", "edge.refused")
        assert len(refused) == 1 and refused[0]["account"] == "alice" and refused[0]["job_id"] == "tagged"
        receiver.finish()


def _lanes_up(pair: Pair, count: int) -> bool:
    return all(len(s.running.link._lanes.active) == count for s in (pair.a, pair.b) if s.running.link._lanes)


def test_items_striped_over_several_connections_arrive_in_order_both_ways(
    tmp_path: Path, pki_ab: PkiLayout, clusters: dict[str, Cluster]
) -> None:
    chunks = [bytes([i]) * (256 * 1024) for i in range(1, 41)]
    with switch_pair(tmp_path, pki_ab, clusters, link_connections="3") as pair:
        wait_for(
            lambda: pair.a.running.link._lanes is not None and _lanes_up(pair, 3), 30, "three connections"
        )
        ends = {}
        for job in ("east", "west"):
            ends[job] = (
                EdgeClient(pair.a, clusters["a"].tokens["alice"], job),
                EdgeClient(pair.b, clusters["b"].tokens["alice"], job),
            )
            for end in ends[job]:
                end.expect("ready")
        east_sender, east_receiver = ends["east"]
        west_receiver, west_sender = ends["west"]
        sent: dict[str, list[bytes]] = {"east": [], "west": []}
        for offset, data in enumerate(chunks):
            for job, sender in (("east", east_sender), ("west", west_sender)):
                raw, _ = encode_chunk(job, "e", 0, 1, offset * len(data), data, offset == len(chunks) - 1)
                sender.send(raw)
                sent[job].append(raw)
        assert [east_receiver.expect_framed() for _ in chunks] == sent["east"]
        assert [west_receiver.expect_framed() for _ in chunks] == sent["west"]
        for switch in (pair.a, pair.b):
            written = switch.running.link.lane_counts()
            written.pop(EXPRESS_LANE, None)  # a route's first item may cross there
            assert len(written) == 3 and all(count > 0 for count in written.values()), written
        for job_ends in ends.values():
            for end in job_ends:
                end.finish()


def test_losing_one_connection_mid_transfer_loses_nothing_and_the_tensors_arrive_exactly(
    tmp_path: Path, pki_ab: PkiLayout, clusters: dict[str, Cluster]
) -> None:
    import torch

    from services.trainer.edge import EdgeConnection, EdgeSettings, GrpcEdgeTransport

    settings = EdgeSettings(ready_timeout_s=30, max_outage_s=60)
    tensors = [torch.randn(256 * 1024, generator=torch.Generator().manual_seed(i)) for i in range(24)]
    with switch_pair(tmp_path, pki_ab, clusters, link_connections="2") as pair:
        wait_for(lambda: pair.a.running.link._lanes is not None and _lanes_up(pair, 2), 30, "two connections")
        sessions_before = pair.a.running.link.state.sessions
        opened: dict[int, EdgeConnection] = {}

        def open_end(index: int) -> None:
            switch, cluster = (pair.a, "a") if index == 0 else (pair.b, "b")
            transport = GrpcEdgeTransport(
                switch.internal_address, clusters[cluster].tokens["bob"], "lanes", "e"
            )
            opened[index] = EdgeConnection(
                transport, job_id="lanes", edge="e", upstream=index == 0, settings=settings
            )

        openers = [threading.Thread(target=open_end, args=(i,), daemon=True) for i in (0, 1)]
        for thread in openers:
            thread.start()
        for thread in openers:
            thread.join(60)
        sender, receiver = opened[0], opened[1]
        received: list[torch.Tensor] = []

        def receive() -> None:
            for step in range(len(tensors)):
                received.append(receiver.receive_tensor(step, 0, timeout=120))

        reader = threading.Thread(target=receive, daemon=True)
        reader.start()
        for step, tensor in enumerate(tensors):
            sender.send_tensor(tensor, step, 0)
            if step == 8:
                wait_for(lambda: len(received) >= 2, 60, "the first tensors to arrive")
                dropped = asyncio.run_coroutine_threadsafe(
                    pair.a.running.link.drop_connection(1), pair.a._loop
                )
                assert dropped.result(10)
        reader.join(180)
        assert len(received) == len(tensors)
        assert all(torch.equal(got, want) for got, want in zip(received, tensors, strict=True))
        assert pair.a.running.link.state.sessions > sessions_before  # the loss ended the session
        closer = threading.Thread(target=receiver.close, daemon=True)  # each close waits for the other's
        closer.start()
        sender.close(timeout=30)
        closer.join(30)
        assert not closer.is_alive()


def test_a_retired_connection_hands_over_without_losing_or_reordering_items(
    tmp_path: Path, pki_ab: PkiLayout, clusters: dict[str, Cluster]
) -> None:
    with switch_pair(tmp_path, pki_ab, clusters, link_connections="3") as pair:
        wait_for(
            lambda: pair.a.running.link._lanes is not None and _lanes_up(pair, 3), 30, "three connections"
        )
        sessions = pair.a.running.link.state.sessions
        sender = EdgeClient(pair.a, clusters["a"].tokens["carol"], "retire")
        receiver = EdgeClient(pair.b, clusters["b"].tokens["carol"], "retire")
        for end in (sender, receiver):
            end.expect("ready")
        sent = []
        stop = threading.Event()

        def send() -> None:
            # Bursts: the first item of each may cross on the express connection (its route had nothing
            # queued), the rest queue and are striped, so the route's order spans both kinds.
            offset = 0
            while not stop.is_set() and len(sent) < 4000:
                for _ in range(8):
                    raw, _ = encode_chunk("retire", "e", 0, 1, offset, b"r" * 1024, False)
                    sender.send(raw)
                    sent.append(raw)
                    offset += 1024
                time.sleep(0.005)

        feeder = threading.Thread(target=send, daemon=True)
        feeder.start()

        def striped() -> bool:
            written = pair.a.running.link.lane_counts()
            written.pop(EXPRESS_LANE, None)
            return len(written) == 3 and all(count > 0 for count in written.values())

        wait_for(striped, 30, "items on all three connections")
        pair.a.running.link.connections = 2  # the dialer retires one connection at its next interval
        wait_for(lambda: _lanes_up(pair, 2), 30, "one connection to be retired on both switches")
        at_retire = len(sent)
        wait_for(lambda: len(sent) > at_retire + 100, 30, "items sent after the retirement")
        stop.set()
        feeder.join(10)
        received = [receiver.expect_framed(timeout=30) for _ in sent]
        assert received == sent  # nothing lost, nothing reordered, nothing twice
        assert pair.a.running.link.state.sessions == sessions  # retiring did not end the session
        for end in (sender, receiver):
            end.finish()
