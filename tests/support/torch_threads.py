"""Tests of tiny tensors train on one torch thread: on a busy 2-core machine more threads only wait on
each other (a codec trial of 3 steps took 33-48 s at load 30 on two threads, 3-4 s on one). The
product's own context manager (the probe and trials of ``codec: auto`` use it) serves the tests too."""

from __future__ import annotations

from nebula_common.sdk.job_probe import one_torch_thread

__all__ = ["one_torch_thread"]
