"""The express connection between two real switches (services/switch/express.py).

Through a shaped link a big job keeps full, a small job's message crosses on the session's express
connection instead of queueing behind the big job's bytes on the first one; a route whose messages
alternate between small and large ones, so that some of them may cross express and some not, still
arrives in the order it was sent; and losing the express connection ends the session like any other
connection of it, after which the link comes back with a new one.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from nebula_common.pki import PkiLayout
from nebula_common.wan.emulator import LinkShape
from services.switch.express import EXPRESS_LANE
from tests.integration.test_switch_data_plane import (  # noqa: F401  (clusters: a module fixture)
    Cluster,
    EdgeClient,
    Pair,
    clusters,
    frame,
    switch_pair,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _express_up(pair: Pair) -> bool:
    for switch in (pair.a, pair.b):
        lanes = switch.running.link._lanes
        if lanes is None or lanes.express is None or not lanes.express.up:
            return False
    return True


def _open(pair: Pair, accounts: dict[str, Cluster], account: str, job: str) -> tuple[EdgeClient, EdgeClient]:
    ends = (
        EdgeClient(pair.a, accounts["a"].tokens[account], job),
        EdgeClient(pair.b, accounts["b"].tokens[account], job),
    )
    for end in ends:
        end.expect("ready")
    return ends


def test_a_small_message_crosses_express_beside_a_full_link_and_a_mixed_route_keeps_its_order(
    tmp_path: Path,
    pki_ab: PkiLayout,
    clusters: dict[str, Cluster],  # noqa: F811
) -> None:
    shape = LinkShape(bandwidth_mbit=40.0, delay_ms=5.0)  # 15 MiB take about 3 s
    with switch_pair(tmp_path, pki_ab, clusters, shape=shape) as pair:
        wait_for(lambda: _express_up(pair), 30, "both switches to run the session's express connection")
        big_sender, big_receiver = _open(pair, clusters, "alice", "big")
        small_sender, small_receiver = _open(pair, clusters, "bob", "small")
        mixed_sender, mixed_receiver = _open(pair, clusters, "carol", "mixed")
        for chunk_id in range(1, 61):
            big_sender.send(frame(chunk_id, payload=256 * 1024))
        wait_for(lambda: pair.a.running.router.buffered_out > 2 << 20, 20, "the big job to queue at switch a")
        express_before = pair.a.running.link.lane_counts().get(EXPRESS_LANE, 0)
        sent = time.monotonic()
        small_sender.send(frame(1001))
        small_receiver.expect("frame", timeout=30)
        small_took = small_receiver.received[-1][1] - sent
        # 32 KiB chunks and small headers in turn, each header sent once the chunk before it left switch
        # a's queue: the header goes express while the chunk may still be on the other connection. A
        # chunk is above what may go express (a fragment, 16 KiB here) and below what the pacer cuts
        # (64 KiB before it measured the link), so it leaves whole and its route never turns bulk.
        router = pair.a.running.router
        express_mixed = pair.a.running.link.lane_counts().get(EXPRESS_LANE, 0)
        route = router._routes[("mixed", "e")]
        for frame_id in range(1, 41):
            if frame_id % 2:
                queued_before = route.last_outbound
                mixed_sender.send(frame(frame_id, payload=32 * 1024))
                continue
            wait_for(
                lambda: route.last_outbound != queued_before and not route.in_ready,  # noqa: B023
                30,
                f"chunk {frame_id - 1} to reach switch a and leave its queue",
            )
            mixed_sender.send(frame(frame_id))
        arrived = [mixed_receiver.expect("frame", timeout=60).frame for _ in range(40)]
        ids = [f.chunk.frame_id if f.HasField("chunk") else f.header.frame_id for f in arrived]
        assert ids == list(range(1, 41))
        assert pair.a.running.link.lane_counts().get(EXPRESS_LANE, 0) >= express_mixed + 20
        chunks = [big_receiver.expect("frame", timeout=60).frame.chunk.frame_id for _ in range(60)]
        assert chunks == list(range(1, 61))
        big_took = big_receiver.received[-1][1] - sent
        # Behind the first connection's queue the small message would wait for a good part of the
        # 15 MiB (the pacer keeps it short, but 40 Mbit/s x 10 ms RTT plus fragments); express it
        # crosses in about a round trip. Measured on an idle machine: 0.04 s against 0.21 s.
        assert pair.a.running.link.lane_counts().get(EXPRESS_LANE, 0) > express_before
        assert small_took < big_took / 4, (small_took, big_took)
        for end in (big_sender, big_receiver, small_sender, small_receiver, mixed_sender, mixed_receiver):
            end.finish()


def test_losing_the_express_connection_ends_the_session_and_the_link_returns_with_a_new_one(
    tmp_path: Path,
    pki_ab: PkiLayout,
    clusters: dict[str, Cluster],  # noqa: F811
) -> None:
    with switch_pair(tmp_path, pki_ab, clusters) as pair:
        wait_for(lambda: _express_up(pair), 30, "both switches to run the session's express connection")
        sessions = pair.a.running.link.state.sessions
        dropped = asyncio.run_coroutine_threadsafe(
            pair.a.running.link.drop_connection(EXPRESS_LANE), pair.a._loop
        )
        assert dropped.result(10)
        wait_for(lambda: pair.a.running.link.state.sessions > sessions, 30, "a new session of the link")
        wait_for(lambda: _express_up(pair), 30, "the new session's express connection")
        downs = pair.audit("b", "link.down") or pair.audit("a", "link.down")
        assert downs, "neither switch audited the session's end"
        sender, receiver = _open(pair, clusters, "alice", "after")
        sender.send(frame(7))
        assert receiver.expect("frame", timeout=30).frame.header.frame_id == 7
        sender.finish()
        receiver.finish()
