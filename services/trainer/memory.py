"""Give memory a finished stage freed back to the operating system (glibc's ``malloc_trim``).

Why: a stage allocates its model, optimizer state, activations and codec buffers on its own
thread; glibc serves each thread from one of up to 8 x cores malloc arenas and keeps what is
freed there for reuse instead of returning it. A trainer that runs many short jobs thus grew
with every job although the Python objects were gone (tracemalloc: a few KiB per job). Trimming
after each stage hands the free pages back; it is a no-op where glibc is not the allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)


def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


_TRIM = _malloc_trim()


def return_freed_memory() -> bool:
    """Release free heap pages of every arena to the OS; False where that is not possible."""
    if _TRIM is None:
        return False
    try:
        _TRIM(0)
    except OSError:
        log.warning("malloc_trim failed", exc_info=True)
        return False
    return True
