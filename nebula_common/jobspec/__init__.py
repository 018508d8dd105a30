"""User-facing job specs: a YAML file plus one Python module per stage (see ``spec.py``)."""

from nebula_common.jobspec.spec import JobSpec, LoadedJob, SpecError, StageModule, load_spec, parse_spec

__all__ = ["JobSpec", "LoadedJob", "SpecError", "StageModule", "load_spec", "parse_spec"]
