"""Prometheus metrics of the trainer: what an operator watches per job and stage."""

from __future__ import annotations

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
