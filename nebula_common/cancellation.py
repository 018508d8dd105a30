"""Stopping a retry loop that a cancellation reached at the wrong moment.

Why: on Python 3.11, ``asyncio.wait_for`` returns the inner result (or raises its error) instead of
``CancelledError`` when the task is cancelled just as the awaited operation finishes (fixed in 3.12).
A retry loop that catches that error and sleeps then runs on with the cancellation lost, and a stop that
waits for the task never ends. ``raise_if_cancelling`` at the top of each retry turns a cancellation that
was requested but swallowed back into ``CancelledError``.
"""

from __future__ import annotations

import asyncio


def raise_if_cancelling() -> None:
    """Raise ``CancelledError`` if the current task was asked to stop (``Task.cancelling()``)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


__all__ = ["raise_if_cancelling"]
