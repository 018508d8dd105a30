"""Waiting on a condition with a deadline and a message, never on a bare sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.02) -> T:
    """Poll ``condition`` every ``interval`` s until it returns something true, and return that.

    Fails naming ``what`` after ``timeout`` seconds. A condition that costs a call (an RPC, a file read)
    may want a longer ``interval``.
    """
    deadline = time.monotonic() + timeout
    while True:
        if value := condition():
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
