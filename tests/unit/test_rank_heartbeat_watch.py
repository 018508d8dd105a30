"""Which cluster ranks the trainer finds lost from their heartbeat counters (``HeartbeatWatch``).

A lost rank fails its stage, so the rule must not take a busy trainer or a stalled rank store for a
dead rank: these readings are the cases it must tell apart, at the times the trainer reads them.
"""

from __future__ import annotations

from services.trainer.runtime.rank_sources import LOST_AFTER_S, WATCH_S, HeartbeatWatch


def readings(watch: HeartbeatWatch, beats: list[list[int]], start: float) -> list[tuple[float, int]]:
    """Feed one reading every ``WATCH_S`` from ``start``; (time, rank) of each rank found lost."""
    found = []
    for i, counts in enumerate(beats):
        now = start + (i + 1) * WATCH_S
        found += [(now, rank) for rank, _ in watch.observe(counts, now)]
    return found


def test_a_rank_whose_counter_stood_still_while_another_beat_is_lost_once_after_the_limit() -> None:
    watch = HeartbeatWatch([0, 0], 0.0)
    steps = int(LOST_AFTER_S / WATCH_S) + 4
    found = readings(watch, [[i + 1, 3] for i in range(steps)], 0.0)  # rank 1 stopped at its 3rd beat
    assert [rank for _, rank in found] == [1]
    assert LOST_AFTER_S <= found[0][0] < LOST_AFTER_S + 2 * WATCH_S


def test_no_rank_is_lost_while_every_counter_moves_or_before_the_limit() -> None:
    watch = HeartbeatWatch([0, 0, 0], 0.0)
    steps = int(LOST_AFTER_S / WATCH_S) - 1
    moving = [[i, i, i // 4] for i in range(1, 4 * steps)]  # rank 2 beats slowly, but beats
    assert readings(watch, moving, 0.0) == []
    still = [[i, 7, i] for i in range(steps)]  # rank 1 stopped, not yet for the limit
    assert readings(HeartbeatWatch([0, 7, 0], 0.0), still, 0.0) == []


def test_counters_that_all_stood_still_at_once_are_the_store_stalling_not_ranks_dying() -> None:
    watch = HeartbeatWatch([5, 5], 0.0)
    assert readings(watch, [[5, 5]] * int(3 * LOST_AFTER_S / WATCH_S), 0.0) == []


def test_a_reading_that_came_late_restarts_the_clock_rather_than_blaming_the_ranks() -> None:
    watch = HeartbeatWatch([0, 0], 0.0)
    assert watch.observe([1, 1], WATCH_S) == []
    # The trainer was starved for longer than the limit: neither counter had a chance to be read.
    assert watch.observe([9, 1], WATCH_S + LOST_AFTER_S + 1) == []
    later = readings(
        watch, [[10 + i, 1] for i in range(int(LOST_AFTER_S / WATCH_S) + 2)], WATCH_S + LOST_AFTER_S + 1
    )
    assert [rank for _, rank in later] == [1]  # and a rank that then stays silent is still found


def test_the_only_rank_is_lost_when_it_stood_still_while_the_watch_ran_on_time() -> None:
    watch = HeartbeatWatch([4], 0.0)
    found = readings(watch, [[4]] * (int(LOST_AFTER_S / WATCH_S) + 1), 0.0)
    assert [rank for _, rank in found] == [0]
