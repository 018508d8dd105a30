"""The SDK's job model refuses bad jobs before anything is sent, naming what is wrong."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from nebula_common.sdk.jobs import AbnetJob


def test_codec_specs_are_canonicalised_and_copied_into_both_stage_specs() -> None:
    job = AbnetJob(job_id="j1", codec_forward=" FP16 ", codec_backward="Int8", steps=7)
    for stage in ("encoder", "decoder"):
        spec = job.stage_spec(stage)
        assert (spec.stage, spec.codec_forward, spec.codec_backward, spec.steps) == (stage, "fp16", "int8", 7)
        assert spec.abnet.d_model == job.d_model and spec.abnet.seed == job.seed


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"codec_forward": "gzip"}, "codec_forward"),
        ({"n_heads": 3}, "n_heads 3 must divide d_model 128"),
        ({"batch_size": 10, "micro_batches": 4}, "multiple of micro_batches"),
        ({"steps": 0}, "steps"),
        ({"job_id": "has space"}, "job_id"),
        ({"unknown_field": 1}, "unknown_field"),
    ],
)
def test_bad_jobs_are_refused_with_the_field_named(fields: dict, named: str) -> None:
    with pytest.raises(ValidationError, match=named):
        AbnetJob(**fields)


def test_job_ids_are_unique_by_default() -> None:
    assert AbnetJob().job_id != AbnetJob().job_id
