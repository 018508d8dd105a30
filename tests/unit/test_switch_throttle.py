"""The per-account token bucket of the switch relay: burst, refill, debt, and idle accounts forgotten."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.switch.throttle import PAUSE_S, AccountThrottle, TokenBucket


def test_a_bucket_gives_its_burst_then_pauses_once_its_debt_is_worth_a_pause() -> None:
    rate = 100.0
    bucket = TokenBucket(rate=rate, burst=3, stamp=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    owed = int(PAUSE_S * rate)  # items of debt a reader may run up before it pauses
    assert [bucket.take(0.0) for _ in range(owed - 1)] == [0.0] * (owed - 1)
    assert bucket.take(0.0) == pytest.approx(PAUSE_S)  # the whole debt is waited off at once
    assert bucket.take(PAUSE_S) == 0.0  # repaid: the next item is free of debt again
    assert bucket.take(10.0) == 0.0  # refill stops at the burst
    assert bucket.tokens == pytest.approx(2.0)


def test_one_account_is_paced_and_another_is_not() -> None:
    throttle = AccountThrottle(rate=200.0, burst=10)

    async def read(account: str, items: int) -> float:
        started = time.monotonic()
        for _ in range(items):
            await throttle.pace(account)
        return time.monotonic() - started

    async def both() -> tuple[float, float]:
        return await asyncio.gather(read("flooder", 110), read("quiet", 10))

    flooder, quiet = asyncio.run(both())
    assert flooder >= 0.45  # (110 - 10) / 200 s, at least
    assert quiet < 0.2  # within its burst: never waits, even beside the flooder


def test_idle_accounts_are_forgotten_and_bad_settings_are_named() -> None:
    throttle = AccountThrottle(rate=1000.0, burst=5)
    asyncio.run(throttle.pace("a"))
    assert len(throttle) == 1
    throttle.sweep(now=time.monotonic() + 1.0)
    assert len(throttle) == 0
    with pytest.raises(ValueError, match="item rate must be > 0"):
        AccountThrottle(rate=0.0, burst=5)
