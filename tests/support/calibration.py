"""A codec calibration of this host for tests that call the in-process advisor, on one torch thread."""

from __future__ import annotations

from pathlib import Path

from nebula_common.codec.calibration import Calibrator
from tests.support.torch_threads import one_torch_thread


def calibrated(directory: Path) -> Calibrator:
    """A calibrator whose calibration ran now, cached in ``directory``."""
    calibrator = Calibrator(directory / "cal.json")
    with one_torch_thread():
        calibrator.run_now()
    return calibrator
