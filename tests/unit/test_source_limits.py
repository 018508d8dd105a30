"""Per-source slots of the WAN frontend (services/switch/source_limits.py): caps per address and in all."""

from __future__ import annotations

from services.switch.source_limits import SourceLimits


def test_one_address_is_capped_and_others_still_get_in() -> None:
    limits = SourceLimits(per_source_pending=2, per_source_relayed=3, total=6)
    assert limits.admit("10.0.0.9") is None and limits.admit("10.0.0.9") is None
    refused = limits.admit("10.0.0.9")
    assert refused == "more than 2 pending connections from one address"
    assert limits.admit("10.0.0.1") is None  # the genuine peer, from its own address
    assert (limits.held_by("10.0.0.9"), limits.held) == (2, 3)
    limits.release("10.0.0.9")
    assert limits.admit("10.0.0.9") is None


def test_a_pending_slot_becomes_a_relayed_one_within_both_caps() -> None:
    limits = SourceLimits(per_source_pending=1, per_source_relayed=1, total=10)
    assert limits.admit("a") is None
    assert limits.move("a", "relayed") is None
    assert limits.admit("a") is None  # its pending slot is free again
    assert limits.move("a", "relayed") == "more than 1 relayed connections from one address"
    assert limits.held_by("a") == 1  # the refused move gave its pending slot back
    limits.release("a", "relayed")
    assert limits.held == 0


def test_the_total_bounds_all_addresses_together() -> None:
    limits = SourceLimits(per_source_pending=5, per_source_relayed=5, total=3)
    assert [limits.admit(f"10.0.0.{n}") for n in range(3)] == [None, None, None]
    assert limits.admit("10.0.0.7") == "more than 3 connections before their handshake, all addresses"


def test_a_known_address_gets_in_whatever_many_others_hold() -> None:
    now = [0.0]
    limits = SourceLimits(
        per_source_pending=2, per_source_relayed=4, total=4, relayed_untrusted=3, clock=lambda: now[0]
    )
    limits.trust("10.0.0.1")  # the peer passed mutual TLS from here before
    for n in range(2, 6):
        assert limits.admit(f"10.0.0.{n}") is None  # four strangers fill the total
    assert limits.admit("10.0.0.9") == "more than 4 connections before their handshake, all addresses"
    assert limits.admit("10.0.0.1") is None and limits.admit("10.0.0.1") is None  # the peer still gets in
    assert limits.admit("10.0.0.1") == "more than 2 pending connections from one address"  # its own caps hold
    now[0] += 24 * 3600 + 1  # a day without an authenticated connection: a stranger again
    assert not limits.trusted("10.0.0.1")
    assert limits.admit("10.0.0.1") == "more than 2 pending connections from one address"


def test_relayed_connections_of_unknown_addresses_leave_room_for_the_known_peer() -> None:
    limits = SourceLimits(per_source_pending=8, per_source_relayed=8, total=100, relayed_untrusted=3)
    for n in range(3):
        assert limits.admit(f"10.0.1.{n}", "relayed") is None
    refused = limits.admit("10.0.1.9", "relayed")
    assert refused == "more than 3 relayed connections of addresses not yet authenticated"
    limits.trust("10.0.0.1")
    assert all(limits.admit("10.0.0.1", "relayed") is None for _ in range(8))  # the peer's lanes
    assert limits.admit("10.0.1.9") is None  # a stranger may still try a pending handshake
