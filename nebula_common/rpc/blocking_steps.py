"""Blocking steps (a TCP connect, a TLS handshake) awaited from asyncio on a thread of their own.

The raw link's dialer and acceptor (``services/switch/rawlink.py``) and the tests of raw connections
run their blocking TLS set-up this way before a ``RawConnection`` exists, so the helper does not live
with the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def in_thread(function: Callable[[], T], name: str) -> T:
    """Run a blocking step on a thread of its own (never the loop's default executor).

    If the caller is cancelled meanwhile, a result that can be closed (a socket) is closed.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def deliver(result: T | None, error: BaseException | None) -> None:
        if future.done():
            closer = getattr(result, "close", None)
            if closer is not None:
                with contextlib.suppress(Exception):
                    closer()
        elif error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = function()
        except BaseException as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(deliver, result, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await future


__all__ = ["in_thread"]
