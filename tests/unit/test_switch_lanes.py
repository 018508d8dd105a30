"""Lanes: items striped over several connections are delivered in order; the lane count tunes itself."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from pydantic import ValidationError

from services.switch.config import SwitchSettings
from services.switch.lanes import LaneGapError, LaneTuner, ReorderBuffer, parse_connections


def test_items_arriving_in_any_order_are_delivered_in_sequence() -> None:
    delivered: list[int] = []
    buffer: ReorderBuffer[int] = ReorderBuffer(delivered.append)
    order = list(range(1, 201))
    random.Random(7).shuffle(order)
    for seq in order:
        buffer.put(seq, seq * 10)
    assert delivered == [seq * 10 for seq in range(1, 201)]
    assert not buffer.waiting


def test_a_duplicate_or_a_gap_past_the_bound_is_an_error() -> None:
    buffer: ReorderBuffer[str] = ReorderBuffer(lambda item: None, bound=3)
    buffer.put(1, "a")
    with pytest.raises(LaneGapError, match="arrived twice"):
        buffer.put(1, "a")
    for seq in (3, 4, 5):
        buffer.put(seq, "x")
    with pytest.raises(LaneGapError, match="wait for item 2, which a lane lost"):
        buffer.put(6, "x")


def test_the_tuner_adds_lanes_while_throughput_grows_and_retires_the_one_that_did_not_help() -> None:
    capacity = {1: 100.0, 2: 190.0, 3: 260.0, 4: 265.0}  # the fourth connection adds under 5%
    tuner = LaneTuner(hold_intervals=3)
    assert tuner.observe(capacity[1], busy=True) == 1  # the first busy interval is only a start
    seen = []
    for _ in range(6):
        seen.append(tuner.observe(capacity[tuner.lanes], busy=True))
    assert seen[:4] == [2, 3, 4, 3]  # probe 4, see no gain, back to 3
    assert tuner.lanes == 3
    assert tuner.observe(capacity[3], busy=True) == 3  # holding


def _run(tuner: LaneTuner, throughput: Callable[[int, int], float], intervals: int) -> list[int]:
    """The lane count after each busy interval; ``throughput(interval, lanes)`` is what the link gave."""
    return [tuner.observe(throughput(i, tuner.lanes), busy=True) for i in range(intervals)]


def test_lanes_added_while_the_link_ramped_up_are_walked_back() -> None:
    # 60 Mbit/s that one connection fills, seen from a cold start: the first busy interval is partly
    # idle and the next one still in slow start, so the first additions look like gains.
    ramp = [30.0, 80.0]

    def link(interval: int, lanes: int) -> float:
        return ramp[interval] if interval < len(ramp) else 100.0

    tuner = LaneTuner(hold_intervals=5)
    counts = _run(tuner, link, 80)
    settled = counts[40:]
    # Without probing down the count stayed at the 2-3 the ramp suggested, forever.
    assert settled.count(1) >= 0.8 * len(settled), f"lane counts after the ramp: {counts}"
    assert max(settled) <= 2, f"lane counts after the ramp: {counts}"


def test_a_retirement_that_costs_throughput_is_restored() -> None:
    capacity = {1: 100.0, 2: 190.0, 3: 260.0, 4: 265.0}  # three connections are what the path needs
    tuner = LaneTuner(hold_intervals=5)
    counts = _run(tuner, lambda i, lanes: capacity[lanes], 80)
    settled = counts[10:]
    assert settled.count(3) >= 0.8 * len(settled), f"lane counts: {counts}"
    assert set(settled) <= {2, 3, 4}, f"lane counts: {counts}"
    assert 2 in settled and 4 in settled  # it keeps probing both ways, one interval at a time


def test_the_tuner_follows_a_path_that_needs_fewer_lanes_later() -> None:
    tuner = LaneTuner(hold_intervals=5)
    needs = {1: 100.0, 2: 190.0, 3: 260.0, 4: 265.0}
    _run(tuner, lambda i, lanes: needs[lanes], 20)
    assert tuner.lanes in (3, 4)
    counts = _run(tuner, lambda i, lanes: 100.0, 60)  # now one connection fills it
    assert counts[-20:].count(1) >= 15, f"lane counts: {counts}"


def test_the_tuner_ignores_idle_intervals() -> None:
    tuner = LaneTuner()
    assert [tuner.observe(10.0, busy=False) for _ in range(5)] == [1] * 5


def test_link_connections_setting_is_a_count_or_auto() -> None:
    assert parse_connections("auto") is None
    assert parse_connections(" 4 ") == 4
    for bad in ("0", "17", "many"):
        with pytest.raises(ValueError, match="link_connections"):
            parse_connections(bad)
    fields = dict(
        cluster_id="a",
        peer_cluster_id="b",
        tls_cert="c",
        tls_key="k",
        trust_bundle="t",
        auth_address="127.0.0.1:1",
        data_dir="d",
    )
    assert SwitchSettings(**fields, link_connections="AUTO").connections() is None
    with pytest.raises(ValidationError, match="link_connections must be"):
        SwitchSettings(**fields, link_connections="lots")
