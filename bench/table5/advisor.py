"""The table's ``auto`` row: the product's own ``codec: auto``, decided in this process on the Table 5 job.

No benchmark-only advisor: this builds the job ``product.py`` submits (``job_files``: the prepared halves
and the training split's token ids, codecs ``auto`` both ways, the run's steps) and resolves ``auto``
with the SDK's code (``nebula_common.sdk.codec_advice.advise_edge``): the micro-batch probe, the codec
service's ranking for the link (``nebula_common.codec.advice.advise``, here in-process on this host's
calibration, as a cluster's codec service runs it) and, when the job is long enough to pay for one, the
trial. The pair it picks becomes the ``auto`` row, trained and scored like every other row, and
``checks.advisor_check`` judges it against the table's rows (the 10% rule).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import job_files
import train

from nebula_common.codec.advice import AdviceRequest, AdviceResult, advise
from nebula_common.codec.calibration import Calibrator
from nebula_common.jobspec import load_spec
from nebula_common.sdk.codec_advice import advise_edge
from nebula_common.sdk.job_probe import probe_micro_batch
from nebula_common.sdk.jobs import ProgramJob
from nebula_common.sdk.links import LinkProfile
from nebula_common.wan import LinkShape

LABEL = "auto"
"""The row's label in ``--rows`` and the report; its codecs are whatever the product's ``auto`` chose."""
CALIBRATION = "codec-calibration.json"
"""This host's codec calibration, cached in the benchmark's cache folder (a codec service caches its own)."""


def auto_pair(prep: train.Prepared, shape: LinkShape, steps: int, cache: Path) -> dict[str, Any]:
    """What the product's ``codec: auto`` picks for the Table 5 job of ``steps`` steps on ``shape``.

    The job trains at the benchmark's batch and learning rate on the prepared halves; its micro-batches
    and schedule are the job file's, as ``product.py`` runs them. Returns the pair and the record a
    job's stages would carry (``codec_choice``: the ranking's alternatives, the trial's reasons).
    """
    config = prep.config
    link = LinkProfile(
        bandwidth_mbit=shape.bandwidth_mbit, rtt_ms=2 * shape.delay_ms, source="the benchmark's link"
    )
    calibrator = Calibrator(cache / CALIBRATION)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="table5-auto-") as scratch:
        files = job_files.stage_files(prep, [])
        placed = {cluster: job_files.place(Path(scratch), held) for cluster, held in files.items()}
        spec = load_spec(job_files.JOB).spec
        overrides = job_files.job_overrides(
            train.Row(LABEL, "auto", "auto"),
            placed,
            steps=steps,
            micro_batches=spec.data.micro_batches,
            examples=len(prep.train_es),
        )
        overrides |= {"data.batch_size": config.tune_batch, "optimizer.lr": config.lr}
        model = {"adapter": config.adapter, "n_heads": config.n_heads, "d_model": config.d_model}
        for index in range(len(job_files.STAGES)):
            overrides |= {f"stages.{index}.options.{key}": value for key, value in model.items()}
        job = ProgramJob(load_spec(job_files.JOB, overrides))

        def ranking(request: AdviceRequest) -> AdviceResult:
            return advise(request, calibrator)

        try:
            forward, backward, record = advise_edge(
                job, 0, probe_micro_batch(job), ranking, link, job.edge_codecs()
            )
        finally:
            calibrator.close()
    seconds = time.perf_counter() - started
    print(json.dumps({"auto": [forward, backward], "seconds": round(seconds, 1)}), flush=True)
    micro_batches = spec.data.micro_batches
    return {
        "forward": forward,
        "backward": backward,
        "choice": record,
        "seconds": seconds,
        "micro_batches": micro_batches,
    }
