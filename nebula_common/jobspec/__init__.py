"""User-facing job specs: a YAML file plus one Python module per stage (see ``spec.py``)."""

from nebula_common.jobspec.loader import LoadedJob, StageModule, load_spec, parse_spec
from nebula_common.jobspec.spec import JobSpec, SpecError

__all__ = ["JobSpec", "LoadedJob", "SpecError", "StageModule", "load_spec", "parse_spec"]
