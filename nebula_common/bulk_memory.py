"""Keep freed memory for reuse in processes that move tensors (glibc ``mallopt``).

Why: by default glibc serves every allocation above a threshold (128 KiB, rising to at most 32 MiB)
with a fresh ``mmap`` and unmaps it on free, and trims the heap top above 128 KiB. A process that
relays or assembles 1-64 MiB chunks and tensors then gets brand-new pages for each one, and the
kernel faults and zeroes every 4 KiB page again: on the relay benchmark (``bench/wan/relay.py``,
64 MiB tensors, `perf`) page faults and ``clear_page`` were 22-36% of a trainer's CPU and 5-12% of a
switch's. With mmap off and a high trim threshold, freed chunks stay in the heap and the next tensor
reuses the same, already-mapped pages (a pooled receive buffer, kept by the allocator).

Applied by the ``nebula-switch`` and ``nebula-trainer`` entry points (``services/*/__main__.py``), not by
the code that starts a service, so tests running services in-process keep glibc's defaults.

The price: memory freed during a run is kept (up to the process's peak) instead of returned at once.
The trainer still returns it after each stage (``services/trainer/memory.py``, ``malloc_trim``).
``NEBULA_MALLOC_KEEP_FREED=0`` leaves glibc's defaults. A no-op where glibc is not the allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_MAX = -4
TRIM_THRESHOLD_BYTES = 1 << 30
"""Free memory at the heap top is returned to the OS only above this (1 GiB)."""
TOP_PAD_BYTES = 64 << 20
"""Extra heap the allocator maps at a time (64 MiB: one large tensor)."""


def keep_freed_memory_for_reuse() -> bool:
    """Serve large allocations from the heap and keep freed pages mapped; False if not applied."""
    if os.environ.get("NEBULA_MALLOC_KEEP_FREED", "1").strip() == "0":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
    applied = all(
        mallopt(option, value) == 1
        for option, value in (
            (M_MMAP_MAX, 0),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
            (M_TOP_PAD, TOP_PAD_BYTES),
        )
    )
    if not applied:
        log.warning("mallopt refused a setting: large allocations keep glibc's defaults")
    return applied


__all__ = ["keep_freed_memory_for_reuse"]
