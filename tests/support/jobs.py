"""Jobs for tests that drive a real deployment: the built-in ``numbers`` job, spec fields overridden."""

from __future__ import annotations

from typing import Any

from nebula_common.jobspec import load_spec
from nebula_common.jobspec.builtin import builtin_spec
from nebula_common.sdk.jobs import ProgramJob


def numbers_job(job_id: str | None = None, **overrides: Any) -> ProgramJob:
    """The demo's built-in ``numbers`` job (encoder in cluster a, decoder in b), spec fields overridden.

    Keys are the spec's dotted paths with ``__`` for the dots, e.g. ``data__batch_size=16``.
    """
    fields = {key.replace("__", "."): value for key, value in overrides.items()}
    return ProgramJob(load_spec(builtin_spec("numbers"), fields), job_id)
