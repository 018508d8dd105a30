"""The paced link: deficit round robin by bytes, fragments, and the pacer against a simulated path."""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Awaitable, Callable

import pytest

from nebula_common.pki import Identity
from nebula_common.proto.nebula.v1 import link_pb2, relay_pb2, tensor_pb2
from nebula_common.rpc.framing import FramedChunk, encode_chunk, parse_chunk
from services.switch import pacing
from services.switch.acks import AckSchedule
from services.switch.lane_tuner import MAX_LANES
from services.switch.link import PeerLink
from services.switch.link_lanes import LANE_INTERVAL_S
from services.switch.pacing import Fragment, LinkPacer, PacingError, Reassembler
from services.switch.route_state import Attachment, Route
from services.switch.routing import Router


def framed(job: str, frame_id: int, size: int, offset: int = 0) -> FramedChunk:
    raw, _ = encode_chunk(job, "e", 0, frame_id, offset, memoryview(bytes([frame_id % 251]) * size), False)
    return parse_chunk(raw)


def header(frame_id: int) -> relay_pb2.EdgeMessage:
    return relay_pb2.EdgeMessage(
        frame=tensor_pb2.TensorFrame(header=tensor_pb2.TensorHeader(frame_id=frame_id, codec="none"))
    )


def size_of(piece: object) -> int:
    if isinstance(piece, Fragment):
        return len(piece.data)
    if isinstance(piece, FramedChunk):
        return len(piece.raw)
    assert isinstance(piece, link_pb2.LinkMessage)
    return piece.ByteSize()


def job_of(piece: object, streams: dict[int, str]) -> str:
    if isinstance(piece, Fragment):
        return streams[piece.stream]
    if isinstance(piece, FramedChunk):
        return piece.job_id
    assert isinstance(piece, link_pb2.LinkMessage)
    return piece.routed.job_id


def test_busy_routes_share_the_link_by_bytes_whatever_their_item_sizes() -> None:
    router = Router(cluster_id="a")
    big, big_at = router.attach(("big", "e"), "alice")
    many, many_at = router.attach(("many", "e"), "bob")
    for i in range(8):  # 8 MiB each, in 1 MiB items and in 64 KiB items
        router.accept_local(big, big_at, framed("big", 1, 1 << 20, i << 20))
    for i in range(128):
        router.accept_local(many, many_at, framed("many", 1, 64 << 10, i << 16))
    sent = {"big": 0, "many": 0}
    gaps = []
    while (piece := router.next_outbound()) is not None:
        sent[job_of(piece, {})] += size_of(piece)
        if min(sent.values()) < 6 << 20:  # while both are busy
            gaps.append(abs(sent["big"] - sent["many"]))
    # Never more than one big item (plus a quantum) apart; item round robin would send 16x as many
    # bytes of the big route.
    assert max(gaps) <= (1 << 20) + (320 << 10), max(gaps)


def test_an_accounts_weight_multiplies_its_share() -> None:
    router = Router(cluster_id="a")
    router.weights = {"alice": 3}
    heavy, heavy_at = router.attach(("heavy", "e"), "alice")
    light, light_at = router.attach(("light", "e"), "bob")
    for i in range(64):
        router.accept_local(heavy, heavy_at, framed("heavy", 1, 64 << 10, i << 16))
        router.accept_local(light, light_at, framed("light", 1, 64 << 10, i << 16))
    sent = {"heavy": 0, "light": 0}
    for _ in range(64):  # both still busy throughout
        piece = router.next_outbound()
        sent[job_of(piece, {})] += size_of(piece)
    assert sent["heavy"] == pytest.approx(3 * sent["light"], rel=0.1), sent


def test_a_paced_link_cuts_big_items_and_a_small_one_waits_at_most_one_fragment() -> None:
    router = Router(cluster_id="a")
    big, big_at = router.attach(("big", "e"), "alice")
    small, small_at = router.attach(("small", "e"), "bob")
    originals = [framed("big", 1, 2 << 20, i * (2 << 20)) for i in range(3)]
    for item in originals:
        router.accept_local(big, big_at, item)
    streams = {big.stream: "big", small.stream: "small"}
    first = router.next_outbound(64 << 10)
    assert isinstance(first, Fragment) and first.offset == 0 and first.whole is originals[0]
    router.accept_local(small, small_at, header(7))  # arrives while the big item is on its way
    rest = list(iter(lambda: router.next_outbound(64 << 10), None))
    # Behind at most one more fragment (the big route's turn had begun), not the rest of 2 MiB.
    assert [job_of(piece, streams) for piece in rest].index("small") <= 1
    # Every fragment joins back into exactly the bytes of the item.
    joined, whole = Reassembler(), []
    for piece in [first, *(p for p in rest if job_of(p, streams) == "big")]:
        assert isinstance(piece, Fragment) and len(piece.data) <= 64 << 10
        message = link_pb2.LinkMessage.FromString(piece.encode())
        if (item := joined.add(message.fragment)) is not None:
            whole.append(item)
    assert whole == [bytes(item.raw) for item in originals]
    assert joined.held == 0


def test_on_a_fast_link_items_shorter_than_the_cut_leave_whole_without_a_copy() -> None:
    router = Router(cluster_id="a")
    route, attachment = router.attach(("job", "e"), "alice")
    item = framed("job", 1, 2 << 20)
    router.accept_local(route, attachment, item)
    pacer = LinkPacer(clock=lambda: 0.0)
    pacer.rate = 300e6  # 2 MiB is 7 ms at 300 MB/s: under CUT_ABOVE_S
    assert pacer.fragment_bytes < len(item.raw) <= pacer.cut_above
    assert router.next_outbound(pacer.fragment_bytes, pacer.cut_above) is item


def _full_pacer() -> LinkPacer:
    pacer = LinkPacer(clock=lambda: 0.0)
    pacer.rate = 7.5e6  # 60 Mbit/s: 15 kB fragments
    pacer.startup = False
    pacer.on_sent(pacer.cap())  # the cap is full: the next acknowledgement makes room
    return pacer


def busy_and_idle_routes() -> tuple[Router, Route, Attachment]:
    """A router whose route of job ``big`` holds 8 MiB, and the idle route of job ``small``."""
    router = Router(cluster_id="a")
    big, big_at = router.attach(("big", "e"), "alice")
    small, small_at = router.attach(("small", "e"), "bob")
    for i in range(4):
        router.accept_local(big, big_at, framed("big", 1, 2 << 20, i * (2 << 20)))
    return router, small, small_at


def test_over_a_full_cap_a_small_jobs_message_passes_and_a_busy_jobs_bytes_wait() -> None:
    router, small, small_at = busy_and_idle_routes()
    pacer = _full_pacer()
    assert router.next_paced(pacer) is None  # the busy route waits for room
    router.accept_local(small, small_at, header(7))  # a small job's message, its route idle before
    piece = router.next_paced(pacer)
    assert isinstance(piece, link_pb2.LinkMessage) and piece.routed.job_id == "small"
    pacer.on_sent(size_of(piece))
    assert router.next_paced(pacer) is None  # and the big route still waits
    # Two more right behind it pass within its first quantum (a fragment's bytes) ...
    router.accept_local(small, small_at, header(8))
    router.accept_local(small, small_at, header(9))
    assert router.next_paced(pacer) is not None
    assert router.next_paced(pacer) is not None
    assert router.next_paced(pacer) is None
    # ... but once the quantum is spent the route waits its turn like any other.
    for i in range(4):
        router.accept_local(small, small_at, framed("small", 2, pacer.fragment_bytes // 2, i))
    passed = 0
    while (piece := router.next_paced(pacer)) is not None:
        pacer.on_sent(size_of(piece))
        passed += 1
    assert passed == 2, passed  # the first two fill its quantum; the rest wait for room


def test_over_a_full_cap_acks_never_wait_for_a_busy_route_and_take_turns_with_a_sparse_one() -> None:
    """An ack and an item take turns only where the item could pass as well: a busy route's fragment
    waits for room, and an ack taking turns with it would wait too."""
    router = Router(cluster_id="a")
    big, big_at = router.attach(("big", "e"), "alice")
    small, small_at = router.attach(("small", "e"), "bob")
    for i in range(4):
        router.accept_local(big, big_at, framed("big", 1, 2 << 20, i * (2 << 20)))
    pacer = _full_pacer()
    ack = relay_pb2.EdgeMessage(ack=relay_pb2.EdgeAck(received=1, max_bytes=1 << 20))
    kinds = []
    for received in range(1, 4):  # a new ack of the big route before every pick: all of them pass
        ack.ack.received = received
        router.accept_local(big, big_at, ack)
        piece = router.next_paced(pacer)
        assert isinstance(piece, link_pb2.LinkMessage), piece
        kinds.append(piece.routed.item.WhichOneof("body"))
    assert kinds == ["ack"] * 3
    router.accept_local(small, small_at, header(7))
    router.accept_local(small, small_at, header(8))
    kinds = []
    for received in range(4, 8):  # beside a sparse route, acks and its items alternate
        ack.ack.received = received
        router.accept_local(big, big_at, ack)
        piece = router.next_paced(pacer)
        assert isinstance(piece, link_pb2.LinkMessage), piece
        kinds.append((piece.routed.job_id, piece.routed.item.WhichOneof("body")))
    assert kinds == [("small", "frame"), ("big", "ack"), ("small", "frame"), ("big", "ack")], kinds


def test_a_tenant_with_many_small_jobs_passes_a_full_cap_by_one_fragment_at_most() -> None:
    many_small_jobs_pass_a_full_cap_by_one_fragment_at_most(Router.next_paced)


def many_small_jobs_pass_a_full_cap_by_one_fragment_at_most(
    take: Callable[[Router, LinkPacer], object | None],
) -> None:
    """A hostile tenant opens 120 routes over 4 accounts (32 each at most) and keeps a small item on
    each, hoping every one passes the cap; ``take`` is the writer's call (one kind of connection)."""
    router = Router(cluster_id="a")
    pacer = _full_pacer()
    cap = pacer.cap()
    for job in range(120):
        route, attachment = router.attach((f"j{job}", "e"), f"mallory-{job % 4}")
        router.accept_local(route, attachment, framed(f"j{job}", 1, 4 << 10))
    passed = 0
    while (piece := take(router, pacer)) is not None:
        pacer.on_sent(size_of(piece))
        passed += 1
    # One fragment's worth of them (and the one that crossed the line), not all 120.
    assert 0 < passed <= pacer.fragment_bytes // (4 << 10) + 1, passed
    assert pacer.inflight <= cap + pacer.fragment_bytes + (5 << 10)


def test_an_item_replaced_in_mid_send_restarts_its_stream() -> None:
    router = Router(cluster_id="a")
    route, attachment = router.attach(("job", "e"), "alice")
    router.accept_local(route, attachment, framed("job", 1, 256 << 10))
    receiver = Reassembler()
    piece = router.next_outbound(64 << 10)
    assert receiver.add(link_pb2.LinkMessage.FromString(piece.encode()).fragment) is None
    router.link_down("cut")  # the partly sent item is purged; the trainer replays
    replay = framed("job", 2, 100 << 10)
    router.accept_local(route, attachment, replay)
    pieces = list(iter(lambda: router.next_outbound(64 << 10), None))
    assert pieces[0].offset == 0
    done = [receiver.add(link_pb2.LinkMessage.FromString(p.encode()).fragment) for p in pieces]
    assert done[-1] == bytes(replay.raw) and receiver.held == 0


def fragment(stream: int, offset: int, size: int, last: bool = False) -> link_pb2.LinkFragment:
    return link_pb2.LinkFragment(stream=stream, offset=offset, data=b"z" * size, last=last)


def test_a_hostile_peers_fragments_are_refused_within_stated_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    receiver = Reassembler()
    receiver.add(fragment(1, 0, 10))
    with pytest.raises(PacingError, match="offset 20, expected 10"):
        receiver.add(fragment(1, 20, 10))
    with pytest.raises(PacingError, match="expected a first fragment"):
        Reassembler().add(fragment(9, 5, 10))
    monkeypatch.setattr(pacing, "MAX_STREAMS", 4)
    crowd = Reassembler()
    for stream in range(4):
        crowd.add(fragment(stream, 0, 1))
    with pytest.raises(PacingError, match="more than 4 fragment streams"):
        crowd.add(fragment(99, 0, 1))
    monkeypatch.setattr(pacing, "MAX_ITEM_BYTES", 100)
    grows = Reassembler()
    grows.add(fragment(1, 0, 60))
    with pytest.raises(PacingError, match="grew past 100 bytes"):
        grows.add(fragment(1, 60, 60))
    monkeypatch.setattr(pacing, "MAX_PARTIAL_BYTES", 150)
    hoard = Reassembler()
    hoard.add(fragment(1, 0, 90))
    with pytest.raises(PacingError, match="exceed 150 bytes"):
        hoard.add(fragment(2, 0, 90))


def test_an_acknowledgement_beyond_what_was_sent_is_refused_and_an_older_one_ignored() -> None:
    pacer = LinkPacer(clock=lambda: 1.0)
    pacer.on_sent(1000)
    pacer.on_ack(600)
    with pytest.raises(PacingError, match="acknowledged 1001 bytes, but only 1000"):
        pacer.on_ack(1001)
    pacer.on_ack(500)  # crossed on another lane after the newer one
    assert pacer.acked == 600 and pacer.inflight == 400


class VirtualTimers:
    """``loop.call_later`` on the simulation's clock."""

    def __init__(self) -> None:
        self._due: list[tuple[float, int, list[Callable[[], None] | None]]] = []

    def call_at(self, when: float, callback: Callable[[], None]) -> VirtualTimer:
        slot: list[Callable[[], None] | None] = [callback]
        heapq.heappush(self._due, (when, len(self._due) + id(slot), slot))
        return VirtualTimer(slot)

    def run_until(self, now: float) -> None:
        while self._due and self._due[0][0] <= now:
            callback = heapq.heappop(self._due)[2][0]
            if callback is not None:
                callback()


class VirtualTimer:
    def __init__(self, slot: list[Callable[[], None] | None]) -> None:
        self._slot = slot

    def cancel(self) -> None:
        self._slot[0] = None


def simulate(
    rates: list[tuple[float, float]],
    delay_s: float,
    seconds: float,
    flows: int = 1,
    quiet_until: float = 0.0,
    more_flows: tuple[float, int] | None = None,
    flows_at: Callable[[float], int] | None = None,
) -> dict[str, list[float]]:
    """A sender with endless data, paced, through one bottleneck FIFO of ``rates`` [(from time, bytes/s)]
    and ``delay_s`` each way; the receiver acknowledges what it reads as the switch does (``AckSchedule``:
    every second piece, an odd one within ``ACK_DELAY_S``). Samples every 10 ms.

    Until ``quiet_until`` the sender has only a 40-byte message every 50 ms (a job's control traffic)
    and tells the pacer when it has nothing to send, as the link's writer does. ``more_flows`` (when,
    how many): the session's connection count changes then, as the lane tuner changes it; ``flows_at``
    (time -> count): the count at every step, as a peer's dialer may set it."""
    now, dt = 0.0, 0.0005
    pacer = LinkPacer(clock=lambda: now)
    pacer.set_flows(flows)
    next_small = 0.0
    queue: list[int] = []  # bytes of each piece waiting at the bottleneck
    head_left = 0.0
    arrivals: list[tuple[float, int]] = []  # (when the receiver reads it, bytes)
    acks: list[tuple[float, int]] = []  # (when the sender reads it, cumulative bytes)
    received = 0
    sent_acks = [0]
    timers = VirtualTimers()

    def acknowledge(lanes: object) -> None:
        heapq.heappush(acks, (now + delay_s, received))
        sent_acks[0] += 1

    owed = AckSchedule(acknowledge, call_later=lambda after, callback: timers.call_at(now + after, callback))
    samples: dict[str, list[float]] = {
        "acks": [],
        "t": [],
        "queue": [],
        "delivered": [],
        "rate": [],
        "rtt": [],
        "fragment": [],
        "cap": [],
    }
    next_sample = 0.0
    while now < seconds:
        rate = [r for start, r in rates if start <= now][-1]
        if more_flows is not None and now >= more_flows[0]:
            pacer.set_flows(more_flows[1])
        if flows_at is not None:
            pacer.set_flows(flows_at(now))
        if now < quiet_until:
            if now >= next_small and pacer.has_room():
                pacer.on_sent(40)
                queue.append(40)
                next_small += 0.05
            elif pacer.has_room():
                pacer.on_idle()
        while now >= quiet_until and pacer.has_room():
            piece = pacer.fragment_bytes
            pacer.on_sent(piece)
            queue.append(piece)
        budget = rate * dt + head_left
        while queue and budget >= queue[0]:
            budget -= queue[0]
            heapq.heappush(arrivals, (now + delay_s, queue.pop(0)))
        head_left = budget if queue else 0.0
        while arrivals and arrivals[0][0] <= now:
            piece = heapq.heappop(arrivals)[1]
            received += piece
            owed.read(0, piece)
        timers.run_until(now)
        while acks and acks[0][0] <= now:
            pacer.on_ack(heapq.heappop(acks)[1])
        if now >= next_sample:
            samples["fragment"].append(pacer.fragment_bytes)
            samples["cap"].append(pacer.cap())
            samples["t"].append(now)
            samples["queue"].append(sum(queue))
            samples["delivered"].append(received)
            samples["acks"].append(sent_acks[0])
            samples["rate"].append(pacer.rate)
            samples["rtt"].append(pacer.min_rtt)
            next_sample += 0.01
        now += dt
    return samples


def window(samples: dict[str, list[float]], start: float, end: float) -> dict[str, list[float]]:
    keep = [i for i, t in enumerate(samples["t"]) if start <= t <= end]
    return {k: [v[i] for i in keep] for k, v in samples.items()}


def test_the_pacer_fills_the_path_and_keeps_its_queue_near_a_fragment() -> None:
    rate, delay = 7.5e6, 0.02  # 60 Mbit/s, 20 ms each way: one bandwidth-delay product is 300 kB
    bdp = rate * 2 * delay
    late = window(simulate([(0.0, rate)], delay, 8.0), 3.0, 8.0)
    throughput = (late["delivered"][-1] - late["delivered"][0]) / (late["t"][-1] - late["t"][0])
    assert throughput >= 0.95 * rate, throughput
    assert late["rate"][-1] == pytest.approx(rate, rel=0.1)
    # The round trip as the pacer sees it: the propagation and its own piece's serialisation.
    assert 2 * delay <= late["rtt"][-1] <= 2 * delay + 2 * pacing.FRAGMENT_TIME_S
    mean_queue = sum(late["queue"]) / len(late["queue"])
    fragment = rate * pacing.FRAGMENT_TIME_S
    # The controller keeps one to two fragments (4-8 ms) queued, and an acknowledgement of two frees
    # room for two at once; a fixed 1 MiB cap would keep 750 kB (100 ms) there.
    assert mean_queue <= 3 * fragment, (mean_queue, bdp)
    assert max(late["queue"]) <= 5 * fragment, max(late["queue"])
    # Every second fragment acknowledged (acks.py): half as many acknowledgements as fragments.
    fragments = (late["delivered"][-1] - late["delivered"][0]) / pacing.MIN_FRAGMENT_BYTES
    acknowledgements = late["acks"][-1] - late["acks"][0]
    assert 0.45 * fragments <= acknowledgements <= 0.55 * fragments, (acknowledgements, fragments)


def test_the_pacer_keeps_one_to_two_fragments_queued_per_connection() -> None:
    # A session striped over 8 connections (lanes.py): Vegas's target is per flow, and each loss-limited
    # connection holds its few fragments in its own send queue; a single-flow target starves them.
    rate, delay, flows = 12.5e6, 0.08, 8  # 100 Mbit/s, 80 ms each way
    late = window(simulate([(0.0, rate)], delay, 12.0, flows=flows), 6.0, 12.0)
    throughput = (late["delivered"][-1] - late["delivered"][0]) / (late["t"][-1] - late["t"][0])
    assert throughput >= 0.95 * rate, throughput
    mean_queue = sum(late["queue"]) / len(late["queue"])
    fragment = rate * pacing.FRAGMENT_TIME_S
    assert 0.8 * flows * fragment <= mean_queue <= 2.5 * flows * fragment, (mean_queue, fragment)


def test_the_pacer_follows_a_path_that_slows_down() -> None:
    fast, slow, delay = 7.5e6, 2.5e6, 0.02
    samples = simulate([(0.0, fast), (4.0, slow)], delay, 12.0)
    late = window(samples, 8.0, 12.0)
    assert late["rate"][-1] == pytest.approx(slow, rel=0.1)
    mean_queue = sum(late["queue"]) / len(late["queue"])
    assert mean_queue <= 3 * pacing.MIN_FRAGMENT_BYTES, mean_queue  # 16 KiB fragments at 20 Mbit/s
    throughput = (late["delivered"][-1] - late["delivered"][0]) / (late["t"][-1] - late["t"][0])
    assert throughput >= 0.95 * slow, throughput


def test_added_connections_carry_what_the_path_now_holds_within_the_lane_tuners_settling() -> None:
    # 100 Mbit/s, 80 ms each way, loss-limited: each connection carries 2.5 MB/s, so the path holds
    # four times as much once the lane tuner goes from one connection to four (at 6 s). The tuner judges
    # the change after LANE_INTERVAL_S of settling: by then the new connections must carry their part,
    # or a doubling that scales the path measures no gain. The controller alone adds one unit per round
    # trip (it took about 3 s here); re-probing as in start-up fills the path within a second.
    per_flow, delay, change = 2.5e6, 0.08, 6.0
    samples = simulate(
        [(0.0, per_flow), (change, 4 * per_flow)], delay, 16.0, flows=1, more_flows=(change, 4)
    )
    before = window(samples, change - 1.0, change)
    cap_before = before["cap"][-1]
    assert all(cap >= cap_before for cap in window(samples, change, 16.0)["cap"])  # never lower
    settled = window(samples, change + 1.0, change + LANE_INTERVAL_S)
    carried = (settled["delivered"][-1] - settled["delivered"][0]) / (settled["t"][-1] - settled["t"][0])
    assert carried >= 0.9 * 4 * per_flow, carried
    # Start-up ends again once the rate stops growing: the queue goes back to the controller's target.
    late = window(samples, change + 6.0, 16.0)
    fragment = 4 * per_flow * pacing.FRAGMENT_TIME_S
    mean_queue = sum(late["queue"]) / len(late["queue"])
    assert mean_queue <= 2.5 * 4 * fragment, (mean_queue, fragment)


def test_a_peer_that_opens_and_retires_connections_over_and_over_keeps_our_queue_bounded() -> None:
    # The dialer decides the connection count (lanes.py), so a hostile peer can open 31 lanes and retire
    # them every 2 s for a minute, each time making the pacer re-enter start-up. It must not ratchet the
    # cap up: the queue toward that peer stays within three bandwidth-delay products and two fragments
    # per connection (the start-ups' round trips are measured over a queue that never drains, so the
    # lowest round trip creeps from 40 to about 52 ms and settles: 1.74 MB at most here, about 230 ms),
    # no higher at the end than at the start, and the link still carries its rate. Only this peer's
    # link pays: the queue is on the path to it.
    rate, delay = 7.5e6, 0.02  # 60 Mbit/s, 20 ms each way: one bandwidth-delay product is 300 kB
    bdp, fragment = rate * 2 * delay, rate * pacing.FRAGMENT_TIME_S
    samples = simulate([(0.0, rate)], delay, 60.0, flows_at=lambda t: MAX_LANES if int(t / 2) % 2 else 1)
    bound = 3 * bdp + 2 * MAX_LANES * fragment
    assert max(samples["queue"]) <= bound, (max(samples["queue"]), bound)
    first, last = window(samples, 4.0, 20.0), window(samples, 44.0, 60.0)
    assert max(last["queue"]) <= 1.1 * max(first["queue"]), (max(first["queue"]), max(last["queue"]))
    assert max(last["cap"]) <= 1.1 * max(first["cap"]), (max(first["cap"]), max(last["cap"]))
    carried = (last["delivered"][-1] - last["delivered"][0]) / (last["t"][-1] - last["t"][0])
    assert carried >= 0.95 * rate, carried


def test_fewer_or_as_many_connections_and_an_unmeasured_link_leave_the_pacer_as_it_was() -> None:
    clock = [0.0]
    pacer = LinkPacer(clock=lambda: clock[0])
    pacer.set_flows(4)  # before any measurement: start-up has not ended, nothing to re-probe
    assert (pacer.startup, pacer.flows) == (True, 4)
    _feed(pacer, clock, 64 << 10, 0.004, 0.04, 3.0)  # 16 MB/s behind a 40 ms round trip
    assert not pacer.startup
    cap = pacer.cap()
    for flows in (4, 2, 1):
        pacer.set_flows(flows)
        assert (pacer.startup, pacer.flows, pacer.cap()) == (False, flows, cap)
    pacer.set_flows(2)
    assert pacer.startup and pacer.cap() >= cap


@pytest.mark.parametrize(("rate", "delay"), [(7.5e6, 0.02), (100e6, 0.002)])
def test_a_link_that_carried_only_small_messages_first_starts_its_tensors_as_fast_as_a_new_one(
    rate: float, delay: float
) -> None:
    # 60 Mbit/s with 20 ms each way, and 100 MB/s with 2 ms: three seconds of a job's control
    # messages, then tensors. Those samples measured the sender (a few kB/s); taken for the path, they
    # ended start-up there and cut the tensors into 16 KiB fragments under the smallest cap.
    quiet = 3.0
    cold = simulate([(0.0, rate)], delay, 2.0)
    warm = simulate([(0.0, rate)], delay, quiet + 2.0, quiet_until=quiet)
    for seconds in (0.5, 2.0):
        fresh = window(cold, 0.0, seconds)["delivered"][-1]
        after = window(warm, quiet, quiet + seconds)
        moved = after["delivered"][-1] - after["delivered"][0]
        assert moved >= 0.9 * fresh, (seconds, moved, fresh)
    late = window(warm, quiet + 1.5, quiet + 2.0)
    assert late["fragment"][-1] == pytest.approx(
        min(pacing.MAX_FRAGMENT_BYTES, max(pacing.MIN_FRAGMENT_BYTES, rate * pacing.FRAGMENT_TIME_S)),
        rel=0.15,
    )
    throughput = (late["delivered"][-1] - late["delivered"][0]) / (late["t"][-1] - late["t"][0])
    assert throughput >= 0.9 * rate, throughput


def _feed(pacer: LinkPacer, clock: list[float], piece: int, every: float, rtt: float, seconds: float) -> None:
    """Writes of ``piece`` bytes every ``every`` seconds, each acknowledged ``rtt`` after it was sent."""
    pending: list[tuple[float, int]] = []
    end = clock[0] + seconds
    while clock[0] < end:
        pacer.on_sent(piece)
        pending.append((clock[0] + rtt, pacer.sent))
        clock[0] += every
        while pending and pending[0][0] <= clock[0]:
            pacer.on_ack(pending.pop(0)[1])
        if every > rtt:
            pacer.on_idle()  # the writer ran dry between its messages


def test_the_delivery_rate_is_measured_where_acknowledgements_come_faster_than_a_sample_spans() -> None:
    # A fast link (a data centre, or loopback): 64 KiB every 0.4 ms, 160 MB/s, each acknowledged within
    # a millisecond. Samples of one write span under MIN_RATE_INTERVAL_S and were skipped; only those
    # across a stall were taken, and the estimate sat at the stalls' rate.
    clock = [0.0]
    pacer = LinkPacer(clock=lambda: clock[0])
    _feed(pacer, clock, 64 << 10, 0.0004, 0.001, 0.5)
    assert pacer.rate == pytest.approx((64 << 10) / 0.0004, rel=0.1)
    assert pacer.fragment_bytes == pytest.approx(pacer.rate * pacing.FRAGMENT_TIME_S, rel=0.01)


def test_a_sender_with_little_to_send_never_lowers_the_rate_it_measured() -> None:
    clock = [0.0]
    pacer = LinkPacer(clock=lambda: clock[0])
    _feed(pacer, clock, 64 << 10, 0.004, 0.04, 2.0)  # 16 MB/s behind a 40 ms round trip
    bulk, fragment = pacer.rate, pacer.fragment_bytes
    assert bulk == pytest.approx((64 << 10) / 0.004, rel=0.1)
    _feed(pacer, clock, 40, 0.05, 0.04, 5.0)  # then a job's control messages only, 800 B/s
    assert (pacer.rate, pacer.fragment_bytes) == (bulk, fragment)


async def _inbound(router: Router, route: object, attachment: object, count: int) -> list[object]:
    items: list[object] = []
    for _ in range(500):
        while (item := router.pop_inbound(route, attachment)) is not None:  # type: ignore[arg-type]
            items.append(item)
        if len(items) >= count:
            return items
        await asyncio.sleep(0.01)
    raise AssertionError(f"only {len(items)} of {count} items arrived within 5 s")


def test_two_paced_switches_carry_big_and_small_items_whole_through_fragments() -> None:
    async def scenario() -> tuple[list[bytes], list[bytes], int, LinkPacer]:
        ab: asyncio.Queue[bytes] = asyncio.Queue()
        ba: asyncio.Queue[bytes] = asyncio.Queue()
        written: list[str] = []

        async def write_ab(message: bytes) -> None:
            written.append(link_pb2.LinkMessage.FromString(message).WhichOneof("body") or "framed")
            await ab.put(message)

        sender, receiver = Router(cluster_id="a"), Router(cluster_id="b")
        a, b = PeerLink("a", "b", sender), PeerLink("b", "a", receiver)
        kwargs = {"peer_paced": True}
        sessions = [
            asyncio.create_task(a.run_session(ba.get, write_ab, Identity("b", "switch"), "dialer", **kwargs)),
            asyncio.create_task(b.run_session(ab.get, ba.put, Identity("a", "switch"), "acceptor", **kwargs)),
        ]
        assert await a.wait_connected(5) and await b.wait_connected(5)
        big, big_at = sender.attach(("big", "e"), "alice")
        small, small_at = sender.attach(("small", "e"), "bob")
        big_in, big_in_at = receiver.attach(("big", "e"), "alice")
        small_in, small_in_at = receiver.attach(("small", "e"), "bob")
        chunks = [framed("big", 1, 1 << 20, i << 20) for i in range(3)]
        for chunk in chunks:
            sender.accept_local(big, big_at, chunk)
        sender.accept_local(small, small_at, framed("small", 1, 100))
        got_big = await _inbound(receiver, big_in, big_in_at, 3)
        got_small = await _inbound(receiver, small_in, small_in_at, 1)
        for _ in range(500):  # the last acknowledgement comes back
            if a._pacer is not None and a._pacer.acked == a._pacer.sent:
                break
            await asyncio.sleep(0.01)
        for session in sessions:
            session.cancel()
        await asyncio.gather(*sessions, return_exceptions=True)
        assert a._pacer is not None
        return (
            [bytes(c.raw) for c in got_big],  # type: ignore[attr-defined]
            [bytes(c.raw) for c in got_small],  # type: ignore[attr-defined]
            written.count("fragment"),
            a._pacer,
        )

    big, small, fragments, pacer = asyncio.run(scenario())
    assert big == [bytes(framed("big", 1, 1 << 20, i << 20).raw) for i in range(3)]
    assert small == [bytes(framed("small", 1, 100).raw)]
    # Before any rate estimate items are cut at 64 KiB: the first big item at least went in pieces.
    assert fragments >= (1 << 20) // pacing.INITIAL_FRAGMENT_BYTES
    assert pacer.sent > 3 << 20 and pacer.acked == pacer.sent


def _last_notice(router: Router, route: Route, attachment: Attachment) -> str:
    """The reason of the last notice the route's trainer got (why its session ended)."""
    notices = []
    while (item := router.pop_inbound(route, attachment)) is not None:
        if item.WhichOneof("body") == "notice":
            notices.append(item.notice.reason)
    return notices[-1]


@pytest.mark.parametrize(
    ("paced", "messages", "reason"),
    [
        (
            True,
            [fragment(1, 0, 10), fragment(1, 99, 1)],
            "peer broke the paced link protocol: fragment of stream 1 at offset 99, expected 10",
        ),
        (False, [fragment(1, 0, 10)], "peer sent a fragment on a session that is not paced"),
        (
            True,
            [link_pb2.LinkReceived(bytes=5)],
            "peer broke the paced link protocol: the peer acknowledged 5 bytes, but only 0 were sent",
        ),
        (False, [link_pb2.LinkReceived(bytes=0)], "peer acknowledged bytes on a session that is not paced"),
        (
            True,
            [
                link_pb2.LinkFragment(
                    stream=3,
                    data=link_pb2.LinkMessage(ping=link_pb2.Ping(nonce=1)).SerializeToString(),
                    last=True,
                )
            ],
            "peer's fragments joined into something else than an item",
        ),
    ],
)
def test_a_hostile_peer_that_breaks_the_paced_protocol_ends_its_session_saying_why(
    paced: bool, messages: list[object], reason: str
) -> None:
    async def scenario() -> str:
        router = Router(cluster_id="a")
        link = PeerLink("a", "b", router)
        route, attachment = router.attach(("j", "e"), "alice")
        inbox: asyncio.Queue[object] = asyncio.Queue()

        async def write(message: bytes) -> None:
            return None

        session = asyncio.create_task(
            link.run_session(inbox.get, write, Identity("b", "switch"), "dialer", peer_paced=paced)
        )
        assert await link.wait_connected(5)
        for message in messages:
            body = "fragment" if isinstance(message, link_pb2.LinkFragment) else "received"
            await inbox.put(link_pb2.LinkMessage(**{body: message}).SerializeToString())
        await asyncio.wait_for(session, 5)
        return _last_notice(router, route, attachment)

    assert reason in asyncio.run(scenario())


async def _marked_session(
    router: Router, write: Callable[[bytes], Awaitable[None]]
) -> tuple[PeerLink, asyncio.Queue[bytes], asyncio.Task[None]]:
    """A paced link session with lanes (both ends announced them), read from the returned queue."""
    link = PeerLink("a", "b", router)
    inbox: asyncio.Queue[bytes] = asyncio.Queue()
    session = asyncio.create_task(
        link.run_session(
            inbox.get,
            write,
            Identity("b", "switch"),
            "dialer",
            session_id=b"s",
            marking=True,
            peer_paced=True,
        )
    )
    assert await link.wait_connected(5)
    return link, inbox, session


def test_a_connection_holds_no_more_than_its_share_of_the_cap_until_the_peer_acknowledges_it() -> None:
    # A lossy long path: a lost segment halves one connection's window and holds its bytes a round trip.
    # Its writer must not keep taking items into that connection's socket (the other connections idle
    # below the cap while it holds it); it takes more once the peer says, on that connection, that it
    # read them. The pacer's cap is shared: 2 connections, each a half and a fragment.
    async def write(message: bytes) -> None:
        return None

    async def scenario() -> None:
        router = Router(cluster_id="a")
        link, _, session = await _marked_session(router, write)
        lanes, pacer = link._lanes, link._pacer
        assert lanes is not None and pacer is not None
        lanes.active.add(1)
        lanes.lane_acks = True  # the peer acknowledges per connection (it did once on any)
        route, attachment = router.attach(("j", "e"), "alice")
        for i in range(64):
            router.accept_local(route, attachment, framed("j", i, 60 << 10))
        share = pacer.cap() / 2 + pacer.fragment_bytes
        while (message := link._next_message(1)) is not None:
            await link._write_item(write, message, lanes, 1)
        assert share <= lanes.unacked(1) < share + (64 << 10), (lanes.unacked(1), share)
        assert link._next_message(0) is not None  # the other connection still takes items
        # The peer read half of what connection 1 carried and says so there: it may take more.
        half = lanes.sent_bytes[1] // 2
        link._lane_acked(lanes, 1, half)
        assert lanes.unacked(1) == lanes.sent_bytes[1] - half
        while (message := link._next_message(1)) is not None:
            await link._write_item(write, message, lanes, 1)
        # A peer that never acknowledged per connection (an older switch) leaves each one unbounded.
        lanes.lane_acks = False
        assert link._next_message(1) is not None
        session.cancel()
        await asyncio.gather(session, return_exceptions=True)

    asyncio.run(scenario())


def test_a_peer_that_acknowledges_more_than_a_connection_carried_ends_the_session() -> None:
    async def write(message: bytes) -> None:
        return None

    async def scenario() -> str:
        router = Router(cluster_id="a")
        route, attachment = router.attach(("j", "e"), "alice")
        _, inbox, session = await _marked_session(router, write)
        forged = link_pb2.LinkReceived(bytes=0, lane_bytes=5)
        await inbox.put(link_pb2.LinkMessage(received=forged).SerializeToString())
        await asyncio.wait_for(session, 5)
        return _last_notice(router, route, attachment)

    assert "peer acknowledged 5 bytes on connection 0, but only 0 were sent there" in asyncio.run(scenario())


def test_the_lane_tuner_measures_the_bytes_the_link_carried_not_whole_items() -> None:
    """A 1 MiB item takes seconds on a lossy long path: counted whole when its first fragment left, a 2 s
    interval measured 0, 1 or 2 items, and the tuner judged each doubling on that noise. A paced session
    counts what the peer acknowledged of ours and what we read of its, fragment by fragment."""

    async def write(message: bytes) -> None:
        return None

    async def scenario() -> None:
        router = Router(cluster_id="a")
        link, _, session = await _marked_session(router, write)
        pacer = link._pacer
        assert pacer is not None
        route, attachment = router.attach(("j", "e"), "alice")
        router.accept_local(route, attachment, framed("j", 1, 1 << 20))
        counted, before = link._carried()
        written = 0
        while written < 300_000 and (message := link._next_message(0)) is not None:
            assert isinstance(message, Fragment), message  # cut: the item is not whole yet
            await link._write_item(write, message, link._lanes, 0)
            written = pacer.sent
        pacer.on_ack(200_000)
        link._read_data(50_000, 0)
        assert link.sent.bytes > 1 << 20  # the old count: the whole item, of which 300 kB left
        assert link._carried() == (counted, before + 250_000)
        session.cancel()
        await asyncio.gather(session, return_exceptions=True)

    asyncio.run(scenario())
