"""A stop reaches a retry loop even when ``asyncio.wait_for`` swallowed its cancellation (Python 3.11).

The switch's dialer caught the error of a handshake read that finished just as the stop cancelled it,
slept and dialed again; the stop then waited forever (seen once in CI: a switch whose peer refused
its link carrier did not stop within 30 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

import pytest

from nebula_common.cancellation import raise_if_cancelling


async def _retry_loop(checked: bool, turns: list[int]) -> None:
    """A dial loop in miniature: wait for a reply that arrives just as the stop cancels the loop."""
    loop = asyncio.get_running_loop()
    me = asyncio.current_task()
    assert me is not None
    while True:
        turns.append(len(turns) + 1)
        reply: asyncio.Future[None] = loop.create_future()
        if len(turns) == 1:  # the reply and the stop in the same turn of the event loop
            loop.call_soon(lambda reply=reply: (reply.set_result(None), me.cancel()))
        else:
            loop.call_soon(reply.set_result, None)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(reply, 10)
        if checked:
            raise_if_cancelling()
        await asyncio.sleep(0.01)
        if len(turns) > 20:
            return  # ran on although it was cancelled


def test_a_cancellation_that_wait_for_swallowed_still_ends_a_checked_retry_loop() -> None:
    async def scenario() -> list[int]:
        turns: list[int] = []
        task = asyncio.create_task(_retry_loop(True, turns))
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), 5)
        return turns

    assert asyncio.run(scenario()) == [1]


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for no longer swallows a cancellation")
def test_without_the_check_the_loop_runs_on_after_its_cancellation() -> None:
    """Pins the interpreter behaviour the check exists for: the first test would fail without it."""

    async def scenario() -> list[int]:
        turns: list[int] = []
        await asyncio.create_task(_retry_loop(False, turns))
        return turns

    assert len(asyncio.run(scenario())) > 20
