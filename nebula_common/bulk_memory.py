"""Keep freed memory for reuse in processes that move tensors (glibc ``mallopt``).

Why: by default glibc serves every allocation above a threshold (128 KiB, rising to at most 32 MiB)
with a fresh ``mmap`` and unmaps it on free, and trims the heap top above 128 KiB. A process that
relays or assembles 1-64 MiB chunks and tensors then gets brand-new pages for each one, and the
kernel faults and zeroes every 4 KiB page again: on the relay benchmark (``bench/wan/relay.py``,
64 MiB tensors, `perf`) page faults and ``clear_page`` were 22-36% of a trainer's CPU and 5-12% of a
switch's. With mmap off and a high trim threshold, freed chunks stay in the heap and the next tensor
reuses the same, already-mapped pages (a pooled receive buffer, kept by the allocator).

One arena (``M_ARENA_MAX`` 1): glibc gives other threads arenas of their own, whose heaps
are at most 64 MiB, and serves an allocation that does not fit one with a fresh ``mmap`` whatever
``M_MMAP_MAX`` says. The receiving edge assembles each tensor on its loop thread, so every 64 MiB
tensor faulted all of its 16,384 pages again: 35% of the receiving trainer's CPU on the relay
benchmark (`perf`, ``docs/bench/relay.md``). With one arena every thread allocates from the main heap,
and the pages are reused as on the main thread.

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
from collections.abc import Callable

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_MAX = -4
M_ARENA_MAX = -8
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
            (M_ARENA_MAX, 1),
        )
    )
    if not applied:
        log.warning("mallopt refused a setting: large allocations keep glibc's defaults")
    return applied


def _bytearray_maker() -> Callable[[int], bytearray]:
    """CPython's ``PyByteArray_FromStringAndSize(NULL, n)``: a bytearray whose bytes are not set."""
    try:
        make = ctypes.pythonapi.PyByteArray_FromStringAndSize
    except AttributeError:  # not CPython
        return bytearray
    make.restype = ctypes.py_object
    make.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
    return lambda size: make(None, size)


_make_bytearray = _bytearray_maker()


def uninitialized_bytearray(size: int) -> bytearray:
    """A ``bytearray`` of ``size`` bytes whose contents are NOT zeroed first, for a buffer the caller
    overwrites completely before anyone reads it (the edge's assembly of a received tensor).

    ``bytearray(size)`` writes ``size`` zero bytes: for a 64 MiB tensor a memset pass over memory
    that the received chunks overwrite at once (with page faults when the pages are new), a fifth of
    the receiving trainer's samples on the relay benchmark (``docs/bench/relay.md``).
    CPython builds the object with ``PyByteArray_FromStringAndSize(NULL, size)``, which allocates
    without writing; elsewhere this is ``bytearray(size)``. A real ``bytearray``, so a decoder may
    adopt it (``tensor_from_bytes``).
    """
    if size < 0:
        raise ValueError(f"a buffer cannot have {size} bytes")
    return _make_bytearray(size) if size else bytearray()


__all__ = ["keep_freed_memory_for_reuse", "uninitialized_bytearray"]
