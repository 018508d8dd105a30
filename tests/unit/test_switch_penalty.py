"""Penalties of the switch relay: which closes are an offence, backoff growth and reset, the job's rate."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import REGISTRY

from nebula_common.proto.nebula.v1 import relay_pb2, tensor_pb2
from services.switch.config import SwitchSettings
from services.switch.route_limits import UNATTACHED_MAX_ITEMS, Limits
from services.switch.routing import Router
from services.switch.throttle import (
    AccountThrottle,
    Penalties,
    PenaltyRules,
    closed_bound,
    is_offence,
)
from tests.support.clock import FakeClock


def header(frame_id: int) -> relay_pb2.EdgeMessage:
    return relay_pb2.EdgeMessage(
        frame=tensor_pb2.TensorFrame(header=tensor_pb2.TensorHeader(frame_id=frame_id, codec="none"))
    )


def test_the_bound_is_read_from_the_routers_own_close_reason() -> None:
    """The reason the peer switch sends is the one Router.close_route writes: parse that, not a copy."""
    router = Router(Limits(max_window_bytes=1 << 20), cluster_id="b")
    for frame_id in range(UNATTACHED_MAX_ITEMS + 1):
        router.deliver(("flood", "e"), header(frame_id))
    closes = [m for m in router._control if m.routed.item.WhichOneof("body") == "close"]
    assert len(closes) == 1, closes
    reason = closes[0].routed.item.close.reason
    assert closed_bound(reason) == "unattached_items", reason
    assert closed_bound("the other cluster's stage failed (bound unattached_items): forged") is None
    assert closed_bound("closed") is None


@pytest.mark.parametrize(
    ("bound", "by_peer", "offence"),
    [
        ("unattached_items", True, True),
        ("unattached_bytes", True, True),
        ("window", True, True),
        ("items", True, True),
        ("credit", False, True),
        # The peer's sender overran our receiver: not our account's fault.
        ("window", False, False),
        ("items", False, False),
        # Slowness and crashes are not misbehaviour.
        ("unattached_timeout", True, False),
        ("orphan_timeout", True, False),
        ("unattached_routes", True, False),
        (None, True, False),
    ],
)
def test_only_bounds_a_sender_of_ours_exceeded_are_offences(
    bound: str | None, by_peer: bool, offence: bool
) -> None:
    assert is_offence(bound, by_peer) is offence


def test_the_backoff_doubles_per_strike_up_to_its_cap_and_resets_after_a_quiet_period() -> None:
    clock = FakeClock()
    penalties = Penalties(PenaltyRules(backoff_min_s=1.0, backoff_max_s=60.0, quiet_s=300.0), clock)
    backoffs = []
    for strike in range(1, 9):
        state = penalties.offend("mallory", f"flood-{strike}", "unattached_items")
        assert state.strikes == strike
        backoffs.append(state.backoff_s)
        clock.now = state.until  # the backoff ends; the flooder re-opens and is closed again
    assert backoffs == [1, 2, 4, 8, 16, 32, 60, 60]
    # Quiet for less than quiet_s after the last backoff: the strikes stay.
    clock.now += 299.0
    assert penalties.offend("mallory", "flood-9", "unattached_items").backoff_s == 60
    # Quiet for quiet_s after the end of that backoff: forgotten, the next offence starts at 1 s.
    clock.now += 60.0 + 300.0
    state = penalties.offend("mallory", "flood-10", "unattached_items")
    assert (state.strikes, state.backoff_s) == (1, 1.0)


def test_closes_during_a_backoff_do_not_double_it_and_refusals_are_audited_once_per_backoff() -> None:
    clock = FakeClock()
    penalties = Penalties(PenaltyRules(backoff_min_s=1.0, backoff_max_s=60.0), clock)
    assert penalties.refusal("mallory") is None
    penalties.offend("mallory", "flood-1", "unattached_items")
    # Three more routes opened before the backoff began are closed within it: still strike 1.
    for job in ("flood-2", "flood-3", "flood-4"):
        assert penalties.offend("mallory", job, "unattached_items").strikes == 1
    before = REGISTRY.get_sample_value("nebula_switch_penalty_refusals_total", {"account": "mallory"}) or 0.0
    first = penalties.refusal("mallory")
    assert first is not None and first.first and first.strikes == 1 and first.bound == "unattached_items"
    assert "penalty backoff" in first.message("a") and "'mallory'" in first.message("a")
    clock.now += 0.5
    again = penalties.refusal("mallory")
    assert again is not None and not again.first and again.remaining_s == pytest.approx(0.5)
    after = REGISTRY.get_sample_value("nebula_switch_penalty_refusals_total", {"account": "mallory"})
    assert after == before + 2  # counted every time, audited (``first``) once
    assert penalties.refusal("alice") is None  # another account is never refused
    clock.now += 0.5
    assert penalties.refusal("mallory") is None  # the backoff is over
    penalties.offend("mallory", "flood-5", "unattached_items")
    second = penalties.refusal("mallory")
    assert second is not None and second.first and (second.strikes, second.backoff_s) == (2, 2.0)


def test_only_the_offending_job_reads_at_the_reduced_rate() -> None:
    penalties = Penalties(PenaltyRules(rate_factor=0.1, quiet_s=300.0))
    throttle = AccountThrottle(rate=1000.0, burst=10, penalties=penalties)
    penalties.offend("mallory", "bad", "credit")
    assert penalties.job_penalized("mallory", "bad")
    assert not penalties.job_penalized("mallory", "good") and not penalties.job_penalized("alice", "bad")

    async def read(job: str, items: int) -> float:
        started = time.monotonic()
        for _ in range(items):
            await throttle.pace("mallory", job)
        return time.monotonic() - started

    # Within the account's burst the good job never waits; the bad one runs at 100 items/s.
    assert asyncio.run(read("good", 5)) < 0.05
    # 54 items at 100 items/s with a burst of 4: 0.5 s, less at most one pause of debt left unpaid.
    assert asyncio.run(read("bad", 54)) >= 0.45


def test_a_penalized_job_is_forgotten_after_the_quiet_period() -> None:
    clock = FakeClock()
    penalties = Penalties(PenaltyRules(quiet_s=10.0), clock)
    penalties.offend("mallory", "bad", "credit")
    clock.now += 10.0
    assert not penalties.job_penalized("mallory", "bad") and not penalties.any_jobs()
    penalties.forget()
    assert penalties.strikes("mallory") == 1  # the backoff ended 9 s ago: strikes kept until quiet
    clock.now += 1.0
    penalties.forget()
    assert penalties.strikes("mallory") == 0


def test_bad_penalty_settings_are_named() -> None:
    with pytest.raises(ValueError, match="penalty rate factor"):
        PenaltyRules(rate_factor=0.0)
    with pytest.raises(ValueError, match="penalty backoff"):
        PenaltyRules(backoff_min_s=10.0, backoff_max_s=1.0)
    with pytest.raises(ValueError, match="penalty_backoff_min_s"):
        SwitchSettings(
            cluster_id="a",
            peer_cluster_id="b",
            tls_cert="c",
            tls_key="k",
            trust_bundle="t",
            auth_address="127.0.0.1:1",
            data_dir="/tmp",
            penalty_backoff_min_s=90.0,
        )
