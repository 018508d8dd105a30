"""The probe ``auto`` predicts from times a job's compute, not the machine's crowd.

The submitter probes while the switches measure the link and, on a shared host, while anything else
runs: a wall clock there counts the waits for a core as compute (beside a CI run the demo's estimate
once doubled, and ``auto`` then mispredicted the step). The probe counts its thread's CPU time.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nebula_common.jobspec import load_spec
from nebula_common.jobspec.builtin import builtin_spec
from nebula_common.sdk.job_probe import probe_micro_batch
from nebula_common.sdk.jobs import ProgramJob

pytestmark = pytest.mark.timeout(120)


def test_a_crowded_cpu_does_not_inflate_the_compute_estimate() -> None:
    job = ProgramJob(load_spec(builtin_spec("numbers"), {}))
    alone = min(probe_micro_batch(job).compute_seconds for _ in range(2))
    spin = [sys.executable, "-c", "while True: pass"]
    hogs = [subprocess.Popen(spin) for _ in range(os.cpu_count() or 2)]
    try:
        crowded = probe_micro_batch(job).compute_seconds
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(30)
    # One spinning process per core: a wall clock measured 2.5-3.5x here, the thread's CPU time 1.2x.
    assert crowded <= 1.6 * alone, f"{crowded * 1e3:.1f} ms crowded against {alone * 1e3:.1f} ms alone"
