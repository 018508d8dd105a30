"""The switch's bounded, non-blocking relay pinned without sockets: bounds, scheduling, sessions, liveness."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from prometheus_client import REGISTRY

from nebula_common.proto.nebula.v1 import link_pb2, relay_pb2, tensor_pb2
from services.switch.link import PeerLink
from services.switch.liveness import MIN_RTT_WINDOW_S, LivenessPolicy, RttEstimator
from services.switch.route_limits import INITIAL_WINDOW_BYTES, SLACK_BYTES, UNATTACHED_MAX_ITEMS, Limits
from services.switch.route_scheduler import ITEM_COST_BYTES, QUANTUM_BYTES
from services.switch.route_state import Attachment, Route, RouteInUseError, RouteLimitError, StaleEpochError
from services.switch.routing import Router

pytestmark = pytest.mark.timeout(30)
KEY = ("job", "e")


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


def header(frame_id: int, step: int = 0) -> relay_pb2.EdgeMessage:
    return relay_pb2.EdgeMessage(
        frame=tensor_pb2.TensorFrame(header=tensor_pb2.TensorHeader(frame_id=frame_id, step=step))
    )


def chunk(frame_id: int, size: int, offset: int = 0) -> relay_pb2.EdgeMessage:
    return relay_pb2.EdgeMessage(
        frame=tensor_pb2.TensorFrame(
            chunk=tensor_pb2.TensorChunk(frame_id=frame_id, offset=offset, data=b"x" * size)
        )
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


def test_scheduler_sends_acks_first_then_each_route_a_quantum_of_bytes_in_turn() -> None:
    async def scenario() -> None:
        router = Router(cluster_id="a")
        big, big_attachment = router.attach(("big", "e"), "alice")
        small, small_attachment = router.attach(("small", "e"), "bob")
        router.accept_local(big, big_attachment, header(1))
        for i in range(30):  # a large tensor: 30 chunks of 256 KiB
            router.accept_local(big, big_attachment, chunk(1, 256 * 1024, offset=i * 256 * 1024))
        for seq in (1, 3, 5):  # frames and signals share one sequence
            router.accept_local(small, small_attachment, header(seq))
            router.accept_local(
                small, small_attachment, relay_pb2.EdgeMessage(signal=relay_pb2.EdgeSignal(seq=seq + 1))
            )
        router.accept_local(small, small_attachment, ack(5))
        router.accept_local(small, small_attachment, ack(7))  # coalesced with the previous one
        order = [(m.routed.job_id, m.routed.item.WhichOneof("body")) for m in drain(router)]
        assert order[0] == ("small", "ack")
        assert sum(1 for o in order if o[1] == "ack") == 1
        small_positions = [i for i, o in enumerate(order) if o[0] == "small" and o[1] != "ack"]
        # Small's route had nothing queued when its items came: it goes first (a new flow), and its six
        # items fit in one quantum of bytes, so all of them leave before any of big's 30 chunks.
        assert small_positions == [1, 2, 3, 4, 5, 6]
        small_items = [o[1] for o in order if o[0] == "small"][1:]
        assert small_items == ["frame", "signal"] * 3  # order kept within the route

    run(scenario)


def test_a_route_of_tiny_items_takes_a_quantum_of_item_costs_per_turn_not_thousands_of_items() -> None:
    """Each item costs at least ITEM_COST_BYTES: by bytes alone one turn of a flood of header frames held
    2,000 of them (seconds of the peer's work) ahead of another busy route's next item."""

    async def scenario() -> None:
        router = Router(cluster_id="a")
        flood, flood_attachment = router.attach(("flood", "e"), "mallory")
        other, other_attachment = router.attach(("other", "e"), "alice")
        for frame_id in range(1, 2001):
            router.accept_local(flood, flood_attachment, header(frame_id))
        for frame_id in range(1, 101):
            router.accept_local(other, other_attachment, header(frame_id))
        order = [m.routed.job_id for m in drain(router)]
        assert order.count("flood") == 2000 and order.count("other") == 100
        last_other = len(order) - 1 - order[::-1].index("other")
        runs, run_length = [], 0
        contested = order[: last_other + 1]  # while both routes have items
        for previous, job in zip(["other", *contested], contested, strict=False):
            run_length = run_length + 1 if job == "flood" and previous == "flood" else int(job == "flood")
            runs.append(run_length)
        assert max(runs) == QUANTUM_BYTES // ITEM_COST_BYTES, max(runs)
        assert order.index("other") <= 1  # one quantum of the flood at most before the other's first item


def test_a_route_that_keeps_acks_coming_cannot_hold_the_other_routes_items() -> None:
    """A flood into a route keeps an ack of it queued; acks and items then take turns, and acks go back to
    back again once no route waits (an ack picked before every item would hold the healthy route)."""

    async def scenario() -> None:
        router = Router(cluster_id="a")
        flooded, flooded_attachment = router.attach(("flooded", "e"), "mallory")
        healthy, healthy_attachment = router.attach(("healthy", "e"), "alice")
        for frame_id in range(1, 6):
            router.accept_local(healthy, healthy_attachment, header(frame_id))
        order = []
        for received in range(1, 11):
            router.accept_local(flooded, flooded_attachment, ack(received))  # a new ack before every pick
            message = router.next_outbound()
            assert message is not None
            order.append((message.routed.job_id, message.routed.item.WhichOneof("body")))
        assert order == [("flooded", "ack"), ("healthy", "frame")] * 5, order
        router.accept_local(flooded, flooded_attachment, ack(11))
        router.accept_local(healthy, healthy_attachment, ack(1))
        assert [m.routed.job_id for m in drain(router)] == ["flooded", "healthy"]

    run(scenario)


def test_a_route_of_tiny_items_takes_a_turn_of_a_few_hundred_not_of_its_bytes_worth() -> None:
    """Each item costs both switches CPU whatever its size: a turn charges every item at least
    ``ITEM_COST_BYTES``, so a flood of headers does not take thousands of items per turn."""

    async def scenario() -> None:
        router = Router(cluster_id="a")
        first, first_at = router.attach(("first", "e"), "alice")
        second, second_at = router.attach(("second", "e"), "mallory")
        for frame_id in range(1, 601):
            router.accept_local(first, first_at, header(frame_id))
            router.accept_local(second, second_at, header(frame_id))
        jobs = [m.routed.job_id for m in drain(router)]
        turns = [len(list(run)) for _, run in itertools.groupby(jobs)]
        assert turns[:4] == [QUANTUM_BYTES // ITEM_COST_BYTES] * 4, turns

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


def test_the_lowest_rtt_is_kept_over_its_window_whatever_the_smoothed_one_says() -> None:
    rtt = RttEstimator()
    assert rtt.min_rtt is None
    rtt.sample(0.040, now=0.0)
    for second in range(1, 20):  # a busy job: queueing adds 100 ms to every sample
        rtt.sample(0.140, now=float(second))
    assert rtt.min_rtt == pytest.approx(0.040) and rtt.srtt is not None and rtt.srtt > 0.12
    rtt.sample(0.090, now=MIN_RTT_WINDOW_S + 1.0)  # the 40 ms sample is out of the window now
    assert rtt.min_rtt == pytest.approx(0.090)
    rtt.sample(0.050, now=MIN_RTT_WINDOW_S + 2.0)
    assert rtt.min_rtt == pytest.approx(0.050)


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

        async def write(raw: bytes) -> None:  # the link writes raw bytes (identity serializers)
            written.append(link_pb2.LinkMessage.FromString(raw))

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


# ----- epochs and vanished trainers (relay.proto, "Epochs" and "A vanished trainer") ----------------


def signal(seq: int, kind: int = relay_pb2.SIGNAL_KIND_RESUME, step: int = 0) -> relay_pb2.EdgeMessage:
    return relay_pb2.EdgeMessage(signal=relay_pb2.EdgeSignal(seq=seq, kind=kind, step=step))


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def inbound(router: Router, route: Route, attachment: Attachment) -> list[relay_pb2.EdgeMessage]:
    out = []
    while (message := router.pop_inbound(route, attachment)) is not None:
        out.append(message)
    return out


def assert_empty(router: Router, route: Route) -> None:
    """Every counter agrees with the (empty) buffers: nothing leaked by a discard."""
    assert router.buffered_in == 0 and router.buffered_out == 0
    assert route.inbound_bytes == 0 and route.inbound_items == 0 and route.outbound_bytes == 0
    assert not route.inbound and not route.outbound and route.inbound_ack is None


def test_epoch_zero_items_are_tagged_zero_and_a_switch_close_carries_the_routes_epoch() -> None:
    async def scenario() -> None:
        router = Router(Limits(max_window_bytes=100_000), cluster_id="a")
        route, attachment = router.attach(KEY, "alice")
        assert route.epoch == 0 and attachment.epoch == 0
        router.accept_local(route, attachment, ack(0, resume=True))
        router.accept_local(route, attachment, header(1))
        assert [m.routed.epoch for m in drain(router)] == [0, 0]
        restarted, at_three = router.attach(("j3", "e"), "alice", epoch=3)
        assert restarted.epoch == 3
        router.accept_local(restarted, at_three, ack(0, resume=True))
        router.accept_local(restarted, at_three, signal(1))
        assert [(m.routed.item.WhichOneof("body"), m.routed.epoch) for m in drain(router)] == [
            ("ack", 3),
            ("signal", 3),
        ]
        for frame_id in range(1, 16):  # beyond credit: the switch closes the route itself
            router.accept_local(restarted, at_three, chunk(frame_id, 20_000))
        (close,) = drain(router)
        assert close.routed.item.close.error and close.routed.epoch == 3

    run(scenario)


def test_a_local_open_at_a_higher_epoch_discards_older_items_both_ways_and_restarts_the_old_stream() -> None:
    async def scenario() -> None:
        router = Router(cluster_id="a")
        route, old = router.attach(KEY, "alice")
        router.deliver(KEY, header(1))
        router.deliver(KEY, signal(2))
        router.deliver(KEY, ack(3))
        router.accept_local(route, old, header(1))
        router.accept_local(route, old, ack(4))
        assert router.buffered_in > 0 and router.buffered_out > 0 and route.inbound_items == 2
        with pytest.raises(RouteInUseError, match="not available"):
            router.attach(KEY, "mallory", epoch=1)  # a higher epoch is no way into another's job
        same, new = router.attach(KEY, "alice", epoch=1)
        assert same is route and route.epoch == 1 and route.attachment is new and new.epoch == 1
        assert_empty(router, route)  # epoch-0 items of both directions are gone, counters with them
        assert old.restart is not None and old.restart.epoch == 1 and old.wake.is_set()
        assert "epoch 1" in old.restart.reason and not old.superseded
        assert router.pop_inbound(route, old) is None and not router.accept_local(route, old, header(2))
        router.end_stream(route, old, None, vanished=True)  # the old stream ending changes nothing
        assert router.get(KEY) is route and route.attachment is new and drain(router) == []
        # The new epoch flows normally.
        router.deliver(KEY, signal(1), epoch=1)
        assert [m.signal.seq for m in inbound(router, route, new)] == [1]
        router.accept_local(route, new, signal(1))
        assert [m.routed.epoch for m in drain(router)] == [1]
        assert_empty(router, route)

    run(scenario)


def test_a_local_open_below_the_routes_epoch_is_stale_and_changes_nothing() -> None:
    async def scenario() -> None:
        router = Router(cluster_id="a")
        route, current = router.attach(KEY, "alice", epoch=2)
        router.deliver(KEY, header(1), epoch=2)
        for reconnect in (False, True):
            with pytest.raises(StaleEpochError) as caught:
                router.attach(KEY, "alice", reconnect=reconnect, epoch=1)
            assert caught.value.route_epoch == 2 and "epoch 2" in caught.value.reason
        assert route.attachment is current and not current.superseded and current.restart is None
        assert [m.frame.header.frame_id for m in inbound(router, route, current)] == [1]

    run(scenario)


def test_items_from_the_peer_below_the_routes_epoch_are_dropped_and_counted() -> None:
    async def scenario() -> None:
        router = Router(cluster_id="b")
        route, attachment = router.attach(KEY, "alice", epoch=1)
        before = metric("nebula_switch_stale_items_total")
        for message in (header(7), signal(8), ack(9), relay_pb2.EdgeMessage(close=relay_pb2.EdgeClose())):
            router.deliver(KEY, message, epoch=0)
        assert metric("nebula_switch_stale_items_total") == before + 4
        assert_empty(router, route)
        assert inbound(router, route, attachment) == [] and router.get(KEY) is route

    run(scenario)


def test_a_higher_epoch_from_the_peer_restarts_the_attached_trainer_and_keeps_its_resume_waiting() -> None:
    async def scenario() -> None:
        now = [0.0]
        audit = Recorder()
        router = Router(
            Limits(unattached_timeout_s=5.0, orphan_timeout_s=50.0),
            cluster_id="b",
            record=audit,
            clock=lambda: now[0],
        )
        router.peer_cluster_id = "a"
        route, old = router.attach(KEY, "alice")
        router.deliver(KEY, header(1))
        router.deliver(KEY, ack(1))
        router.accept_local(route, old, header(1))
        router.accept_local(route, old, ack(2))
        now[0] = 1.0
        router.deliver(KEY, signal(1), epoch=2)  # cluster a's restarted stage: its RESUME
        assert route.epoch == 2 and route.attachment is None and router.get(KEY) is route
        assert old.restart is not None and old.restart.epoch == 2 and old.wake.is_set()
        assert "cluster 'a'" in old.restart.reason and "epoch 2" in old.restart.reason
        assert router.next_outbound() is None  # the old epoch's items toward a are void
        assert (
            route.inbound_items == 1
            and route.inbound_bytes == router.buffered_in == signal(1).signal.ByteSize()
        )
        assert not router.accept_local(route, old, header(2))
        router.end_stream(route, old, None)  # the old stream ends: the route stays for its successor
        assert router.get(KEY) is route and drain(router) == []
        router.deliver(KEY, header(2), epoch=0)  # late items of the old epoch: stale
        assert route.inbound_items == 1
        with pytest.raises(StaleEpochError):
            router.attach(KEY, "alice", reconnect=True, epoch=0)
        same, new = router.attach(KEY, "alice", epoch=2)
        assert same is route
        (resume,) = inbound(router, route, new)
        assert resume.signal.kind == relay_pb2.SIGNAL_KIND_RESUME
        assert_empty(router, route)
        assert audit.records == []

    run(scenario)


def test_a_route_restarted_by_the_peer_is_bounded_like_an_unattached_route() -> None:
    async def scenario() -> None:
        now = [0.0]
        router = Router(Limits(unattached_timeout_s=5.0), cluster_id="b", clock=lambda: now[0])
        route, old = router.attach(KEY, "alice")
        now[0] = 10.0
        router.deliver(KEY, signal(1), epoch=1)
        assert old.restart is not None and route.attachment is None
        now[0] = 14.0
        router.sweep()
        assert router.get(KEY) is route  # the timeout counts from the restart, not the route's birth
        now[0] = 15.5
        router.sweep()
        assert router.get(KEY) is None
        (close,) = drain(router)
        assert "unattached_timeout" in close.routed.item.close.reason and close.routed.epoch == 1
        assert router.buffered_in == 0
        # Bytes: the unattached bound, not the attached one.
        route, old = router.attach(("big", "e"), "alice")
        router.deliver(("big", "e"), chunk(1, INITIAL_WINDOW_BYTES + SLACK_BYTES), epoch=1)
        assert (
            router.get(("big", "e")) is None
            and "unattached_bytes" in drain(router)[0].routed.item.close.reason
        )
        assert router.buffered_in == 0

    run(scenario)


def test_with_no_attachment_a_higher_epoch_replaces_older_buffered_items() -> None:
    async def scenario() -> None:
        router = Router(cluster_id="b")
        router.deliver(KEY, header(1))
        router.deliver(KEY, ack(1))
        router.deliver(KEY, signal(1), epoch=1)
        route = router.get(KEY)
        assert route is not None and route.epoch == 1 and route.inbound_items == 1
        assert route.inbound_ack is None and router.buffered_in == route.inbound_bytes
        with pytest.raises(StaleEpochError):
            router.attach(KEY, "alice")
        _, attachment = router.attach(KEY, "alice", epoch=1)
        assert [m.WhichOneof("body") for m in inbound(router, route, attachment)] == ["signal"]
        assert_empty(router, route)

    run(scenario)


def test_a_higher_epoch_passes_the_tombstone_of_an_older_one() -> None:
    async def scenario() -> None:
        router = Router(Limits(unattached_timeout_s=1.0), cluster_id="b", clock=lambda: 0.0)
        for frame_id in range(1, UNATTACHED_MAX_ITEMS + 2):
            router.deliver(KEY, header(frame_id))
        assert router.get(KEY) is None
        drain(router)
        router.deliver(KEY, header(1))  # tombstoned
        assert router.get(KEY) is None
        router.deliver(KEY, signal(1), epoch=1)  # a new attempt: a new route
        route = router.get(KEY)
        assert route is not None and route.epoch == 1 and route.inbound_items == 1

    run(scenario)


def test_a_vanished_trainer_orphans_its_route_and_a_reconnect_continues_it() -> None:
    async def scenario() -> None:
        now = [0.0]
        router = Router(
            Limits(orphan_timeout_s=30.0, unattached_timeout_s=1.0), cluster_id="a", clock=lambda: now[0]
        )
        route, first = router.attach(KEY, "alice")
        router.deliver(KEY, header(1))
        router.accept_local(route, first, header(1))
        router.end_stream(route, first, None, vanished=True)
        assert router.get(KEY) is route and route.detached == "orphaned"
        # Nothing for the peer but what the trainer queued before it vanished: no close.
        assert [m.routed.item.WhichOneof("body") for m in drain(router)] == ["frame"]
        assert router.buffered_in == 0  # the reconnecting trainer's resume ack makes the peer replay
        router.deliver(KEY, header(2))  # same epoch while orphaned: not buffered
        router.deliver(KEY, ack(1))  # the peer's credit is kept
        assert route.inbound_items == 0 and route.inbound_ack is not None
        now[0] = 20.0  # past the unattached timeout, within the orphan timeout
        router.sweep()
        assert router.get(KEY) is route
        router.link_down("cut")  # an orphan survives a link blip (buffers purged)
        assert router.get(KEY) is route and router.buffered_in == 0
        router.link_came_up()
        same, second = router.attach(KEY, "alice", reconnect=True)
        assert same is route and route.detached is None and route.attachment is second
        router.deliver(KEY, header(3))
        assert [m.frame.header.frame_id for m in inbound(router, route, second)] == [3]
        router.accept_local(route, second, header(2))
        assert [m.routed.item.frame.header.frame_id for m in drain(router)] == [2]
        now[0] = 100.0
        router.sweep()
        assert router.get(KEY) is route  # attached again: no orphan timeout
        assert_empty(router, route)

    run(scenario)


def test_a_restarted_trainer_continues_an_orphaned_route_at_a_higher_epoch() -> None:
    async def scenario() -> None:
        router = Router(cluster_id="a")
        route, first = router.attach(KEY, "alice")
        router.end_stream(route, first, None, vanished=True)
        router.deliver(KEY, signal(1), epoch=1)  # the peer restarted too: its RESUME is kept
        assert route.epoch == 1 and route.detached == "orphaned" and route.inbound_items == 1
        router.deliver(KEY, signal(2), epoch=1)
        assert route.inbound_items == 2  # the orphaned epoch was 0: epoch-1 items are buffered
        same, restarted = router.attach(KEY, "alice", epoch=1)
        assert same is route and route.detached is None
        assert len(inbound(router, route, restarted)) == 2
        assert_empty(router, route)

    run(scenario)


def test_an_orphan_nobody_reattaches_is_closed_to_the_peer_audited_and_counted() -> None:
    async def scenario() -> None:
        now = [0.0]
        audit = Recorder()
        router = Router(Limits(orphan_timeout_s=30.0), cluster_id="a", record=audit, clock=lambda: now[0])
        route, attachment = router.attach(KEY, "alice", epoch=2)
        now[0] = 5.0
        router.end_stream(route, attachment, None, vanished=True)
        before = metric("nebula_switch_routes_closed_total", reason="orphan_timeout")
        now[0] = 34.0
        router.sweep()
        assert router.get(KEY) is route and drain(router) == []
        now[0] = 35.5
        router.sweep()
        assert router.get(KEY) is None
        (close,) = drain(router)
        reason = close.routed.item.close.reason
        assert close.routed.item.close.error and close.routed.epoch == 2
        assert "cluster 'a'" in reason and "30 s" in reason and "orphan_timeout" in reason, reason
        ((event, fields),) = audit.records
        assert (
            event == "route.closed" and fields["account"] == "alice" and fields["bound"] == "orphan_timeout"
        )
        assert metric("nebula_switch_routes_closed_total", reason="orphan_timeout") == before + 1
        router.deliver(KEY, header(1), epoch=2)  # tombstoned
        assert router.get(KEY) is None
        _, again = router.attach(KEY, "alice", epoch=3)  # a later restart may still open it
        assert again.epoch == 3

    run(scenario)


def test_a_clean_close_still_reaches_the_peer_at_once_and_orphans_count_against_route_limits() -> None:
    async def scenario() -> None:
        router = Router(Limits(max_routes_per_account=2), cluster_id="a")
        route, attachment = router.attach(KEY, "alice", epoch=1)
        router.end_stream(route, attachment, relay_pb2.EdgeClose(reason="cancelled", error=True))
        (close,) = drain(router)
        assert close.routed.item.close.reason == "cancelled" and close.routed.epoch == 1
        assert router.get(KEY) is None
        one, first = router.attach(("j1", "e"), "alice")
        router.attach(("j2", "e"), "alice")
        router.end_stream(one, first, None, vanished=True)
        with pytest.raises(RouteLimitError, match="max_routes_per_account = 2"):
            router.attach(("j3", "e"), "alice")  # the orphan is still held for alice
        router.attach(("j1", "e"), "alice", reconnect=True)  # re-attaching to it needs no room

    run(scenario)


def test_the_peers_close_reaches_a_trainer_that_reattaches_to_its_orphan() -> None:
    async def scenario() -> None:
        router = Router(cluster_id="a")
        route, first = router.attach(KEY, "alice")
        router.end_stream(route, first, None, vanished=True)
        router.deliver(KEY, relay_pb2.EdgeMessage(close=relay_pb2.EdgeClose(reason="finished")))
        assert router.get(KEY) is route
        _, second = router.attach(KEY, "alice", reconnect=True)
        (message,) = inbound(router, route, second)
        assert message.close.reason == "finished"

    run(scenario)


def test_revoked_credentials_close_only_their_routes_to_both_sides() -> None:
    """An account's revoked tokens, or the revoked certificate its trainer presented, end its live routes:
    an error close to the peer and to the attached trainer, audited with bound ``credential``."""

    async def scenario() -> None:
        audit = Recorder()
        router = Router(cluster_id="a", record=audit)
        alice, alice_end = router.attach(("job-1", "e"), "alice", issued_at=100.0, serial=0xA)
        router.attach(("job-2", "e"), "bob", issued_at=100.0, serial=0xB)
        carol, _ = router.attach(("job-3", "e"), "carol", issued_at=300.0, serial=0xC)

        def reason_of(account: str, issued_at: float) -> str | None:
            # Tokens of alice issued before t=200 are revoked (a disable at t=200).
            return "token revoked: account disabled" if account == "alice" and issued_at < 200 else None

        assert router.close_revoked(reason_of, frozenset({0xB})) == 2
        assert router.get(("job-1", "e")) is None and router.get(("job-2", "e")) is None
        assert router.get(("job-3", "e")) is carol  # neither revoked
        closes = {m.routed.job_id: m.routed.item.close for m in drain(router)}
        assert (
            closes["job-1"].error
            and "account 'alice': token revoked: account disabled" in closes["job-1"].reason
        )
        assert "certificate b its trainer opened it with is revoked" in closes["job-2"].reason
        told = router.pop_inbound(alice, alice_end)
        assert told is not None and told.close.error and "account disabled" in told.close.reason
        bounds = [
            (fields["account"], fields["bound"]) for event, fields in audit.records if event == "route.closed"
        ]
        assert bounds == [("alice", "credential"), ("bob", "credential")]
        assert router.close_revoked(reason_of, frozenset({0xB})) == 0  # once

    run(scenario)


def test_an_expired_token_closes_its_routes_unless_its_owner_renewed_them() -> None:
    """A route ends once its token's ``exp`` is before ``expired_before``; ``renew`` moves only the
    renewing account's routes of that one job onto the new token."""

    async def scenario() -> None:
        router = Router(cluster_id="a", record=Recorder())
        renewed, _ = router.attach(("job-1", "e"), "alice", issued_at=0.0, expires_at=100.0)
        router.attach(("job-1", "f"), "alice", issued_at=0.0, expires_at=100.0)
        lapsed, lapsed_end = router.attach(("job-2", "e"), "alice", issued_at=0.0, expires_at=100.0)
        router.attach(("job-3", "e"), "bob", issued_at=0.0, expires_at=100.0)
        never, _ = router.attach(("job-4", "e"), "bob")  # no expiry known: only revocation ends it

        def nobody(account: str, issued_at: float) -> str | None:
            return None

        assert router.close_revoked(nobody, expired_before=100.0) == 0  # not past yet
        assert router.renew("job-1", "alice", 90.0, 190.0) == 2
        assert router.renew("job-3", "alice", 90.0, 190.0) == 0  # bob's job: not alice's to extend
        assert router.close_revoked(nobody, expired_before=150.0) == 2
        assert router.get(("job-1", "e")) is renewed and renewed.expires_at == 190.0
        assert renewed.issued_at == 90.0
        assert router.get(("job-2", "e")) is None and router.get(("job-3", "e")) is None
        assert router.get(("job-4", "e")) is never
        told = router.pop_inbound(lapsed, lapsed_end)
        assert told is not None and told.close.error and "expired" in told.close.reason
        assert "account 'alice'" in told.close.reason

    run(scenario)
