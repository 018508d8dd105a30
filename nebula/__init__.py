"""Nebula's one-import SDK: ``from nebula import Deployment, Job``.

``Deployment`` is a running deployment (``Deployment.from_run_dir("runs/local")``, or any
``deployment.json``); ``Deployment.submit`` takes a spec path, YAML text or dict and returns a
``Job``, which waits with progress, streams metrics, summarises, cancels and reports. The parts
underneath stay in ``nebula_common.sdk`` for whoever needs one piece of them.
"""

from __future__ import annotations

from nebula_common.jobspec import SpecError
from nebula_common.sdk.api import Deployment, Job, load_job
from nebula_common.sdk.job_records import JobNotFoundError, JobRecord
from nebula_common.sdk.summary import JobSummary

__all__ = ["Deployment", "Job", "JobNotFoundError", "JobRecord", "JobSummary", "SpecError", "load_job"]
