"""The SDK's job model refuses bad jobs before anything is sent, naming what is wrong."""

from __future__ import annotations

import json

import pytest

from nebula_common.jobspec import SpecError, load_spec
from nebula_common.jobspec.builtin import builtin_spec
from nebula_common.sdk.jobs import ProgramJob


def numbers_job(overrides: dict | None = None, job_id: str | None = None) -> ProgramJob:
    return ProgramJob(load_spec(builtin_spec("numbers"), overrides), job_id)


def test_codec_specs_are_canonicalised_and_copied_into_both_stage_specs() -> None:
    overrides = {"edges.0.codec.forward": " FP16 ", "edges.0.codec.backward": "Int8", "steps": 7}
    job = numbers_job(overrides, job_id="j1")
    for stage in ("encoder", "decoder"):
        spec = job.stage_spec(stage)
        assert (spec.stage, spec.codec_forward, spec.codec_backward, spec.steps) == (stage, "fp16", "int8", 7)
        assert spec.job_id == "j1" and spec.edge == "encoder->decoder"
        assert json.loads(spec.program.options_json)["d_model"] == 128 and spec.program.seed == job.spec.seed


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"edges.0.codec.forward": "gzip"}, "edges.0.codec.forward"),
        ({"data.batch_size": 10, "data.micro_batches": 4}, "multiple of micro_batches"),
        ({"steps": 0}, "steps"),
        ({"unknown_field": 1}, "unknown_field"),
    ],
)
def test_bad_jobs_are_refused_with_the_field_named(overrides: dict, named: str) -> None:
    with pytest.raises(SpecError, match=named):
        numbers_job(overrides)


def test_a_bad_job_id_is_refused() -> None:
    with pytest.raises(ValueError, match="job_id"):
        numbers_job(job_id="has space")


def test_job_ids_are_unique_by_default() -> None:
    assert numbers_job().job_id != numbers_job().job_id
