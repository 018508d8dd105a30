"""When a paced session's reader acknowledges: every second data message per connection, an odd one on a
timer, and no timer of an ended session firing into the next (``services/switch/acks.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

import pytest

from services.switch.acks import ACK_AT_ONCE_BYTES, ACK_DELAY_S, AckSchedule


class Timers:
    """``call_later`` that records its timers; the test fires them."""

    def __init__(self) -> None:
        self.armed: list[tuple[float, Callable[[], None], Handle]] = []

    def call_later(self, after: float, callback: Callable[[], None]) -> Handle:
        handle = Handle()
        self.armed.append((after, callback, handle))
        return handle

    def live(self) -> list[tuple[float, Callable[[], None], Handle]]:
        return [timer for timer in self.armed if not timer[2].cancelled]

    def fire(self) -> None:
        for _, callback, handle in self.live():
            handle.cancelled = True
            callback()


class Handle:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def schedule() -> tuple[AckSchedule, list[list[int]], Timers]:
    owed: list[list[int]] = []
    timers = Timers()

    def due(lanes: Iterable[int]) -> None:
        owed.append(sorted(lanes))

    return AckSchedule(due, call_later=timers.call_later), owed, timers


def test_every_second_message_on_a_connection_is_acknowledged_at_once_and_an_odd_one_on_a_timer() -> None:
    acks, owed, timers = schedule()
    acks.read(0)
    assert owed == [] and acks.pending == 1
    assert [after for after, _, _ in timers.live()] == [ACK_DELAY_S]
    acks.read(0)
    assert owed == [[0]] and acks.pending == 0
    assert timers.live() == []  # nothing left to wait for: the timer is gone
    acks.read(0)
    timers.fire()
    assert owed == [[0], [0]] and acks.pending == 0


def test_a_large_message_is_acknowledged_at_once_and_a_small_one_just_under_waits() -> None:
    # A fast link's whole items: an acknowledgement held for the next one reads to the pacer as a queue.
    acks, owed, timers = schedule()
    acks.read(0, ACK_AT_ONCE_BYTES - 1)
    assert owed == [] and len(timers.live()) == 1
    acks.sent(0)
    acks.read(0, ACK_AT_ONCE_BYTES)
    assert owed == [[0]] and acks.pending == 0 and timers.live() == []


def test_connections_are_counted_apart_and_the_timer_covers_every_one_left_waiting() -> None:
    acks, owed, timers = schedule()
    acks.read(1)
    acks.read(2)
    assert owed == [] and acks.pending == 2
    assert len(timers.live()) == 1  # one timer for the session, not one per connection
    acks.read(2)
    assert owed == [[2]] and acks.pending == 1
    assert len(timers.live()) == 1  # connection 1 still waits
    timers.fire()
    assert owed == [[2], [1]]


def test_an_acknowledgement_written_covers_its_connection_and_one_for_all_covers_every_one() -> None:
    acks, owed, timers = schedule()
    acks.read(1)
    acks.read(2)
    acks.sent(1)
    assert acks.pending == 1 and len(timers.live()) == 1
    acks.sent(2)
    assert acks.pending == 0 and timers.live() == []
    acks.read(1)
    acks.read(2)
    acks.sent(None)
    assert acks.pending == 0 and timers.live() == [] and owed == []


def test_a_reset_leaves_nothing_owed_and_no_timer_of_the_old_session() -> None:
    acks, owed, timers = schedule()
    acks.read(0)
    (_, old_callback, old_handle) = timers.armed[0]
    acks.reset()
    assert acks.pending == 0 and old_handle.cancelled
    old_callback()  # a timer that raced its cancel finds nothing to acknowledge
    assert owed == []


@pytest.mark.parametrize(("every", "delay"), [(0, 0.002), (2, -1.0)])
def test_a_schedule_that_could_never_acknowledge_is_refused(every: int, delay: float) -> None:
    with pytest.raises(ValueError, match="acknowledge every >= 1 message within >= 0 s"):
        AckSchedule(lambda lanes: None, every=every, delay_s=delay)


def test_on_the_event_loop_an_odd_message_is_acknowledged_within_the_delay() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        owed = asyncio.Event()
        acks = AckSchedule(lambda lanes: owed.set())
        start = loop.time()
        acks.read(0)
        await asyncio.wait_for(owed.wait(), timeout=10.0)
        return loop.time() - start

    waited = asyncio.run(main())
    assert waited >= ACK_DELAY_S * 0.9, waited  # the loop's clock may round a little
