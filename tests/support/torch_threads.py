"""Tests of tiny tensors train on one torch thread: on a busy 2-core machine more threads only wait on
each other (a codec trial of 3 steps took 33-48 s at load 30 on two threads, 3-4 s on one)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch's intra-op threads set to 1 inside the block, and back to what they were after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
