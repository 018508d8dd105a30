"""Prometheus metrics of the trainer: what an operator watches per job and stage.

Per-job series (labels ``job_id``, ``stage``) leave ``/metrics`` a grace period after their stage
ended (``SeriesReaper``): long enough for the last scrape to see the final values, short enough
that a trainer running thousands of jobs does not export (and keep in memory) every one forever.
"""

from __future__ import annotations

import contextlib
import heapq
import threading
import time

from prometheus_client import Counter, Gauge, Histogram

STEP_SECONDS = Histogram(
    "nebula_trainer_step_seconds",
    "Wall time of one optimizer step.",
    ["job_id", "stage"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
WAIT_SECONDS = Counter(
    "nebula_trainer_wait_seconds",
    "Time spent waiting for tensors from the other cluster.",
    ["job_id", "stage"],
)
STEPS_TOTAL = Counter("nebula_trainer_steps", "Optimizer steps completed.", ["job_id", "stage"])
LOSS = Gauge(
    "nebula_trainer_loss", "Training loss of the last step (loss-owning stage only).", ["job_id", "stage"]
)
STAGES_RUNNING = Gauge("nebula_trainer_stages_running", "Stages currently running on this trainer.")
STAGES_FINISHED = Counter(
    "nebula_trainer_stages_finished",
    "Stages that ended on this trainer, by final state (no job or account label).",
    ["state"],
)
for _state in ("succeeded", "failed", "cancelled"):
    STAGES_FINISHED.labels(_state)
PER_STAGE = (STEP_SECONDS, WAIT_SECONDS, STEPS_TOTAL, LOSS)
STAGE_CODEC = Gauge(
    "nebula_trainer_stage_codec",
    "1 per stage: the codecs it uses each way, and whether they were configured or advised (codec: auto).",
    ["job_id", "stage", "forward", "backward", "choice"],
)
_CODECS: dict[tuple[str, str], tuple[str, str, str]] = {}
_CODECS_LOCK = threading.Lock()


def record_codecs(job_id: str, stage: str, forward: str, backward: str, choice: str) -> None:
    """The codecs a starting stage uses (``choice``: the spec's codec_choice; "" means configured)."""
    labels = (
        forward or "none",
        backward or "none",
        "configured" if choice in ("", "configured") else "advised",
    )
    with _CODECS_LOCK:
        old = _CODECS.pop((job_id, stage), None)
        if old is not None:
            STAGE_CODEC.remove(job_id, stage, *old)
        _CODECS[(job_id, stage)] = labels
        STAGE_CODEC.labels(job_id, stage, *labels).set(1)


def record_step(job_id: str, stage: str, elapsed: float, waited: float, loss: float | None) -> None:
    """One step of a stage on this trainer's ``/metrics`` (called for a stage process by its supervisor)."""
    STEP_SECONDS.labels(job_id, stage).observe(elapsed)
    WAIT_SECONDS.labels(job_id, stage).inc(waited)
    STEPS_TOTAL.labels(job_id, stage).inc()
    if loss is not None:
        LOSS.labels(job_id, stage).set(loss)


def forget_stage(job_id: str, stage: str) -> None:
    """Remove every per-stage series of (``job_id``, ``stage``) now (those it never had are skipped)."""
    for metric in PER_STAGE:
        with contextlib.suppress(KeyError):  # a stage that never stepped has no series
            metric.remove(job_id, stage)
    with _CODECS_LOCK:
        codecs = _CODECS.pop((job_id, stage), None)
        if codecs is not None:
            STAGE_CODEC.remove(job_id, stage, *codecs)


class SeriesReaper:
    """Forgets finished stages' series after a grace period, on one thread for the whole process.

    One thread with a deadline heap instead of a timer per stage: a trainer that ends many stages
    holds one thread, not one per stage still in its grace period.
    """

    def __init__(self) -> None:
        self._due: list[tuple[float, int, str, str]] = []
        self._serial = 0
        self._condition = threading.Condition()
        self._thread: threading.Thread | None = None

    def forget_after(self, job_id: str, stage: str, grace_s: float) -> None:
        """Remove the stage's series ``grace_s`` seconds from now (at once if ``grace_s`` <= 0)."""
        if grace_s <= 0:
            forget_stage(job_id, stage)
            return
        with self._condition:
            self._serial += 1
            heapq.heappush(self._due, (time.monotonic() + grace_s, self._serial, job_id, stage))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="metrics-reaper", daemon=True)
                self._thread.start()
            self._condition.notify()

    def pending(self) -> int:
        with self._condition:
            return len(self._due)

    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._due or self._due[0][0] > time.monotonic():
                    timeout = self._due[0][0] - time.monotonic() if self._due else None
                    self._condition.wait(timeout)
                _, _, job_id, stage = heapq.heappop(self._due)
            forget_stage(job_id, stage)


REAPER = SeriesReaper()
