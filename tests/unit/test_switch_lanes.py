"""Lanes: items striped over several connections are delivered in order; the lane count tunes itself."""

from __future__ import annotations

import random

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
    seen = []
    for _ in range(6):
        seen.append(tuner.observe(capacity[tuner.lanes], busy=True))
    assert seen[:4] == [2, 3, 4, 3]  # probe 4, see no gain, back to 3
    assert tuner.lanes == 3
    assert tuner.observe(capacity[3], busy=True) == 3  # holding


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
