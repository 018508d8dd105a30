"""SIGTERM before a service's handler exists: held by the kernel instead of killing the process.

A service started by the launcher could be stopped in the first tens of milliseconds after exec,
before Python had installed its handlers; the default action killed it (exit -15, not 0). So the
launcher starts every service with SIGINT and SIGTERM blocked (a blocked signal waits, pending, and
the mask survives exec), and the service's entry point unblocks them once its handlers are in place:
a signal that came early is delivered then and handled like any other.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block SIGINT and SIGTERM in this thread while the block runs: a child started in it inherits
    the mask (the parent's own signals only wait, and arrive at the end of the block)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def unblock_stop_signals() -> None:
    """For a process started with them blocked: let SIGINT and SIGTERM (and any that wait) arrive."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
