"""How every service process announces itself, waits, and shuts down."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)


async def serve_until_signalled(announcement: dict[str, Any], stop: Callable[[], Awaitable[None]]) -> None:
    """Print the one JSON line launchers read to learn our ports, then run until SIGINT/SIGTERM.

    A signal triggers ``stop`` (health NOT_SERVING, drain calls) instead of
    killing the process mid-call, so orchestrators get graceful shutdowns.
    """
    sys.stdout.write(json.dumps(announcement) + "\n")
    sys.stdout.flush()
    log.info("serving", extra={"fields": announcement})
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    try:
        await stopping.wait()
        log.info("stopping")
    finally:
        await stop()
