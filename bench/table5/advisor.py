"""The benchmark's advisor: ``nebula_common.codec.trial`` choosing among the table's own rows.

Why it is here and not the product's ``auto``: it sees the rows run.py trains (the learned bottleneck
included) in one process, with the trial's loss and progress rules, and its pick is judged against the
table's BLEU verdicts (``checks.advisor_check``). The product's ``auto`` (codec-service advice, then a
trial on the running job) is timed and judged by ``product.py``.
"""

from __future__ import annotations

import json
import time
from typing import Any

import train

from nebula_common.codec.trial import Candidate, Link, TrialRun, choose_by_trial
from nebula_common.wan import LinkShape

Row = train.Row

ADVISOR_LOSS_TOLERANCE = 0.02
"""The advisor's own budget (it cannot decode BLEU in a calibration): trial loss within 2% of none's."""
ADVISOR_PROGRESS_TOLERANCE = 0.10
"""And the trial-loss gap may be at most 10% of what none's loss fell during the trial (the first half's
mean minus the last half's): a harmful row's gap opens as training starts to pay, when it is still ~1-2%
of the loss (the probes of docs/bench/table5.md: at 90 steps the bottleneck rows were +1.6-2.2% over none)."""
ADVISOR_MAX_TRIALS = 6
"""Rows trained in the trial at most, fastest-predicted first (several bottleneck rows are predicted fast)."""


def advise(prep: train.Prepared, rows: tuple[Row, ...], shape: LinkShape, trial_steps: int) -> dict[str, Any]:
    """``codec: auto`` on the benchmark: the trial advisor (``nebula_common.codec.trial``) over the rows.

    It sees what a job would before it starts: the link's bandwidth and RTT, a few real steps per
    row (compute and frame bytes -> predicted s/step), and ``trial_steps`` steps of the
    fastest-predicted rows against none's (seed 0, same data), never the table's BLEU or timings.
    """
    by_label = {row.label: row for row in rows}

    def run(candidate: Candidate, steps: int) -> TrialRun:
        done = train.train_steps(prep, by_label[candidate.label], seed=0, steps=steps)
        return TrialRun(done.losses, done.compute_seconds, done.forward_bytes[-1], done.backward_bytes[-1])

    started = time.perf_counter()
    link = Link(bandwidth_bps=shape.bandwidth_mbit * 1e6, rtt_seconds=2 * shape.delay_ms / 1000)
    decision = choose_by_trial(
        [Candidate(row.forward, row.backward, row.label) for row in rows[1:]],
        run,
        link,
        tolerance=ADVISOR_LOSS_TOLERANCE,
        progress_tolerance=ADVISOR_PROGRESS_TOLERANCE,
        max_trials=ADVISOR_MAX_TRIALS,
        trial_steps=trial_steps,
        baseline=Candidate(rows[0].forward, rows[0].backward, rows[0].label),
    )
    record = {**decision.record(), "seconds": time.perf_counter() - started}
    print(json.dumps({"advisor": record["label"], "seconds": round(record["seconds"], 1)}), flush=True)
    return record
