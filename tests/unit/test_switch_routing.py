"""The switch's bounded, non-blocking relay pinned without sockets: bounds, scheduling, sessions, liveness."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from nebula_common.proto.nebula.v1 import link_pb2, relay_pb2, tensor_pb2
from services.switch.link import LivenessPolicy, PeerLink, RttEstimator
from services.switch.routing import (
    INITIAL_WINDOW_BYTES,
    SLACK_BYTES,
    UNATTACHED_MAX_ITEMS,
    Limits,
    RouteLimitError,
    Router,
)

pytestmark = pytest.mark.timeout(30)
KEY = ("job", "e")


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


def header(frame_id: int, step: int = 0) -> relay_pb2.EdgeMessage:
    return relay_pb2.EdgeMessage(
        frame=tensor_pb2.TensorFrame(header=tensor_pb2.TensorHeader(frame_id=frame_id, step=step))
    )


def chunk(frame_id: int, size: int) -> relay_pb2.EdgeMessage:
    return relay_pb2.EdgeMessage(
        frame=tensor_pb2.TensorFrame(chunk=tensor_pb2.TensorChunk(frame_id=frame_id, data=b"x" * size))
    )


def ack(received: int, resume: bool = False) -> relay_pb2.EdgeMessage:
    return relay_pb2.EdgeMessage(ack=relay_pb2.EdgeAck(received=received, max_bytes=1 << 20, resume=resume))


class Recorder:
    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, event: str, **fields: Any) -> None:
        self.records.append((event, fields))


def drain(router: Router) -> list[link_pb2.LinkMessage]:
    out = []
    while (message := router.next_outbound()) is not None:
        out.append(message)
    return out


def test_unattached_route_over_its_item_bound_is_closed_back_to_the_sender_and_tombstoned() -> None:
    async def scenario() -> None:
        audit = Recorder()
        router = Router(cluster_id="b", record=audit)
        for frame_id in range(1, UNATTACHED_MAX_ITEMS + 2):
            router.deliver(KEY, header(frame_id))  # never waits, whatever the route's state
        assert router.get(KEY) is None and router.buffered_in == 0
        (close,) = drain(router)
        assert close.routed.job_id == "job" and close.routed.item.close.error
        reason = close.routed.item.close.reason
        assert "switch 'b'" in reason and "unattached_items" in reason and str(UNATTACHED_MAX_ITEMS) in reason
        router.deliver(KEY, header(99_999))  # tombstoned: dropped cheaply, no new route
        assert router.get(KEY) is None and drain(router) == []
        ((event, fields),) = audit.records
        assert event == "route.closed" and fields["outcome"] == "refused" and fields["job_id"] == "job"
        assert fields["edge"] == "e" and fields["bound"] == "unattached_items"

    run(scenario)


def test_unattached_route_byte_bound_and_timeout() -> None:
    async def scenario() -> None:
        now = [0.0]
        router = Router(Limits(unattached_timeout_s=5.0), cluster_id="b", clock=lambda: now[0])
        router.deliver(("big", "e"), chunk(1, INITIAL_WINDOW_BYTES + SLACK_BYTES))
        router.deliver(("slow", "e"), header(1))
        assert router.get(("big", "e")) is None
        assert "unattached_bytes" in drain(router)[0].routed.item.close.reason
        now[0] = 4.0
        router.sweep()
        assert router.get(("slow", "e")) is not None
        now[0] = 5.5
        router.sweep()
        assert router.get(("slow", "e")) is None
        (close,) = drain(router)
        assert (
            "unattached_timeout" in close.routed.item.close.reason and "5 s" in close.routed.item.close.reason
        )

    run(scenario)


def test_the_peer_cannot_create_more_unattached_routes_than_the_limit() -> None:
    async def scenario() -> None:
        router = Router(Limits(max_unattached_routes=3), cluster_id="b")
        for job in range(5):
            router.deliver((f"j{job}", "e"), header(1))
        assert sum(1 for j in range(5) if router.get((f"j{j}", "e")) is not None) == 3
        closes = drain(router)
        assert [c.routed.job_id for c in closes] == ["j3", "j4"]
        assert all("unattached_routes" in c.routed.item.close.reason for c in closes)

    run(scenario)


def test_attached_route_over_the_window_is_closed_to_both_sides() -> None:
    async def scenario() -> None:
        router = Router(Limits(max_window_bytes=100_000), cluster_id="b")
        route, attachment = router.attach(KEY, "alice")
        other, other_attachment = router.attach(("job2", "e"), "alice")
        router.deliver(("job2", "e"), header(1))
        for frame_id in range(1, 16):  # 300 KB, above 2 x 100 KB + slack
            router.deliver(KEY, chunk(frame_id, 20_000))
        message = router.pop_inbound(route, attachment)
        assert message is not None and message.close.error and "bound window" in message.close.reason
        assert router.pop_inbound(route, attachment) is None
        assert "bound window" in drain(router)[0].routed.item.close.reason
        # The other route of the same account is untouched.
        kept = router.pop_inbound(other, other_attachment)
        assert kept is not None and kept.frame.header.frame_id == 1

    run(scenario)


def test_a_trainer_sending_beyond_credit_is_closed_and_told_why() -> None:
    async def scenario() -> None:
        router = Router(Limits(max_window_bytes=100_000), cluster_id="a")
        route, attachment = router.attach(KEY, "alice")
        assert router.accept_local(route, attachment, ack(0, resume=True))
        accepted = [router.accept_local(route, attachment, chunk(i, 20_000)) for i in range(1, 16)]
        assert (
            accepted[-1] is False
            and route.closed_reason is not None
            and "bound credit" in route.closed_reason
        )
        message = router.pop_inbound(route, attachment)
        assert message is not None and message.close.error  # told why
        assert drain(router)[-1].routed.item.close.error  # and the peer too

    run(scenario)


def test_scheduler_sends_acks_first_then_one_item_per_route_in_turn() -> None:
    async def scenario() -> None:
        router = Router(cluster_id="a")
        big, big_attachment = router.attach(("big", "e"), "alice")
        small, small_attachment = router.attach(("small", "e"), "bob")
        router.accept_local(big, big_attachment, header(1))
        for _ in range(30):  # a large tensor: 30 chunks of 256 KiB
            router.accept_local(big, big_attachment, chunk(1, 256 * 1024))
        for frame_id in (1, 2, 3):
            router.accept_local(small, small_attachment, header(frame_id))
            router.accept_local(
                small, small_attachment, relay_pb2.EdgeMessage(signal=relay_pb2.EdgeSignal(seq=10))
            )
        router.accept_local(small, small_attachment, ack(5))
        router.accept_local(small, small_attachment, ack(7))  # coalesced with the previous one
        order = [(m.routed.job_id, m.routed.item.WhichOneof("body")) for m in drain(router)]
        assert order[0] == ("small", "ack")
        assert sum(1 for o in order if o[1] == "ack") == 1
        small_positions = [i for i, o in enumerate(order) if o[0] == "small" and o[1] != "ack"]
        assert small_positions == [2, 4, 6, 8, 10, 12]  # interleaved, not behind 30 chunks
        small_items = [o[1] for o in order if o[0] == "small"][1:]
        assert small_items == ["frame", "signal"] * 3  # order kept within the route

    run(scenario)


def test_link_loss_purges_and_notifies_and_the_route_stays_attached() -> None:
    async def scenario() -> None:
        router = Router(cluster_id="a")
        router.link_came_up()
        route, attachment = router.attach(KEY, "alice")
        router.accept_local(route, attachment, ack(0, resume=True))
        router.accept_local(route, attachment, header(1))
        router.deliver(KEY, header(1))
        router.deliver(("nobody", "e"), header(1))
        quiet, quiet_attachment = router.attach(("quiet", "e"), "bob")  # sent nothing yet
        router.link_down("cut")
        assert router.get(("nobody", "e")) is None and router.get(KEY) is route
        assert router.buffered_out == 0 and router.next_outbound() is None
        message = router.pop_inbound(route, attachment)
        assert message is not None and message.notice == relay_pb2.LinkNotice(up=False, reason="cut")
        told = router.pop_inbound(quiet, quiet_attachment)
        assert told is not None and told.notice == relay_pb2.LinkNotice(up=False, reason="cut")
        router.accept_local(route, attachment, header(2))  # sent during the outage: replayed later
        router.link_came_up()
        message = router.pop_inbound(route, attachment)
        assert message is not None and message.notice.up
        assert router.next_outbound() is None
        router.accept_local(route, attachment, header(3))
        assert drain(router)[0].routed.item.frame.header.frame_id == 3

    run(scenario)


def test_reconnect_takes_over_only_for_the_same_account_and_keeps_buffered_items() -> None:
    async def scenario() -> None:
        router = Router(cluster_id="a")
        route, first = router.attach(KEY, "alice")
        router.deliver(KEY, header(1))
        with pytest.raises(Exception, match="already open"):
            router.attach(KEY, "alice")
        with pytest.raises(Exception, match="not available"):
            router.attach(KEY, "mallory", reconnect=True)
        again, second = router.attach(KEY, "alice", reconnect=True)
        assert again is route and first.superseded and first.wake.is_set()
        assert router.pop_inbound(route, first) is None
        message = router.pop_inbound(route, second)
        assert message is not None and message.frame.header.frame_id == 1
        router.end_stream(route, first, relay_pb2.EdgeClose(reason="x", error=True))  # the old one: no effect
        assert router.next_outbound() is None and router.get(KEY) is route

    run(scenario)


def test_routes_per_account_and_per_switch_are_limited() -> None:
    async def scenario() -> None:
        router = Router(Limits(max_routes_per_account=2, max_attached_routes=3), cluster_id="a")
        router.attach(("j1", "e"), "alice")
        router.attach(("j2", "e"), "alice")
        with pytest.raises(RouteLimitError, match="max_routes_per_account = 2"):
            router.attach(("j3", "e"), "alice")
        router.attach(("k1", "e"), "bob")
        with pytest.raises(RouteLimitError, match="max_attached_routes = 3"):
            router.attach(("k2", "e"), "bob")

    run(scenario)


def test_rtt_estimator_follows_rfc_6298_and_timeouts_are_clamped() -> None:
    rtt = RttEstimator()
    assert rtt.rto() == 1.0
    rtt.sample(0.1)
    assert rtt.srtt == pytest.approx(0.1) and rtt.rttvar == pytest.approx(0.05)
    rtt.sample(0.2)
    assert rtt.rttvar == pytest.approx(0.75 * 0.05 + 0.25 * 0.1)
    assert rtt.srtt == pytest.approx(0.875 * 0.1 + 0.125 * 0.2)
    assert rtt.rto() == pytest.approx(rtt.srtt + 4 * rtt.rttvar)
    policy = LivenessPolicy()
    assert policy.interval(rtt) == pytest.approx(4 * rtt.rto())
    assert policy.dead_after(rtt) == 10.0  # floor
    slow = RttEstimator()
    slow.sample(3.0)
    assert policy.interval(slow) == 10.0 and policy.dead_after(slow) == 60.0


def test_a_silent_peer_ends_the_session_and_attached_routes_hear_of_it() -> None:
    async def scenario() -> None:
        router = Router(cluster_id="a")
        link = PeerLink(
            "a",
            "b",
            router,
            liveness=LivenessPolicy(interval_min_s=0.1, interval_max_s=0.1, dead_min_s=0.5, dead_max_s=0.8),
        )
        route, attachment = router.attach(KEY, "alice")
        router.accept_local(route, attachment, ack(0, resume=True))
        written: list[link_pb2.LinkMessage] = []

        async def never() -> object:
            await asyncio.sleep(3600)
            return None

        async def write(message: link_pb2.LinkMessage) -> None:
            written.append(message)

        from nebula_common.pki import Identity

        await asyncio.wait_for(link.run_session(never, write, Identity("b", "switch"), "dialer"), 5)
        assert any(m.WhichOneof("body") == "ping" for m in written)
        notices = []
        while (message := router.pop_inbound(route, attachment)) is not None:
            notices.append(message)
        # The up notice nobody read yet was purged with the rest: the trainer hears the news, once.
        assert [n.notice.up for n in notices] == [False]
        assert "nothing received from the peer switch" in notices[-1].notice.reason
        assert not link.connected

    run(scenario)
