"""What a trainer forgets of finished stages: metric series after a grace period, runners after a
time or beyond a count."""

from __future__ import annotations

import time

import pytest
from prometheus_client import REGISTRY

from services.trainer.metrics import (
    LOSS,
    STEP_SECONDS,
    STEPS_TOTAL,
    WAIT_SECONDS,
    SeriesReaper,
    record_codecs,
)
from services.trainer.retention import FinishedStages

pytestmark = pytest.mark.timeout(30)


def _series(job_id: str) -> list[str]:
    """Names of the samples /metrics would show for ``job_id``."""
    return [
        sample.name
        for metric in REGISTRY.collect()
        for sample in metric.samples
        if sample.labels.get("job_id") == job_id
    ]


def _step(job_id: str, stage: str) -> None:
    record_codecs(job_id, stage, "int8", "fp16", "")
    STEP_SECONDS.labels(job_id, stage).observe(0.1)
    WAIT_SECONDS.labels(job_id, stage).inc(0.01)
    STEPS_TOTAL.labels(job_id, stage).inc()
    LOSS.labels(job_id, stage).set(1.5)


def test_a_finished_stages_series_stay_for_the_grace_period_then_leave() -> None:
    reaper = SeriesReaper()
    _step("reaped-1", "encoder")
    _step("kept-1", "encoder")
    # A grace long enough that the two scrapes below fit in it on a loaded machine (one collect of the
    # whole registry of a test session took over 0.5 s beside two CI runs).
    reaper.forget_after("reaped-1", "encoder", 3.0)
    forgotten_at = time.monotonic()
    seen = _series("reaped-1")  # the last scrape still sees the final values
    assert time.monotonic() - forgotten_at < 3.0, "the scrape took the whole grace period"
    assert "nebula_trainer_loss" in seen and "nebula_trainer_stage_codec" in seen, seen
    deadline = time.monotonic() + 15
    while _series("reaped-1"):
        assert time.monotonic() < deadline, f"series still exported: {_series('reaped-1')}"
        time.sleep(0.02)
    assert time.monotonic() - forgotten_at >= 2.95
    assert reaper.pending() == 0
    assert "nebula_trainer_steps_total" in _series("kept-1")  # another job's series stay


def test_a_zero_grace_forgets_at_once_and_a_stage_without_series_is_fine() -> None:
    reaper = SeriesReaper()
    _step("reaped-2", "decoder")
    reaper.forget_after("reaped-2", "decoder", 0)
    assert _series("reaped-2") == []
    reaper.forget_after("never-stepped", "decoder", 0)


def test_finished_stages_are_forgotten_oldest_first_by_count_and_by_age() -> None:
    finished = FinishedStages(ttl_s=100.0, max_count=2)
    assert finished.add("a", now=0.0) == []
    assert finished.add("b", now=1.0) == []
    assert finished.add("c", now=2.0) == ["a"]  # beyond the count
    assert finished.expire(now=50.0) == []
    assert finished.expire(now=101.5) == ["b"]  # older than the ttl
    assert len(finished) == 1
    with pytest.raises(ValueError, match="max_count >= 1"):
        FinishedStages(ttl_s=1.0, max_count=0)
