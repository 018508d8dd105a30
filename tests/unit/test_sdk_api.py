"""The one-import SDK without a cluster: one import, specs from a path, YAML text or a dict, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import nebula
from nebula import Deployment, Job, SpecError, load_job
from nebula_common.sdk.deployment import DeploymentFileError

pytestmark = pytest.mark.timeout(30)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digit_sum" / "job.yaml"


def test_one_import_gives_the_whole_api() -> None:
    assert {"Deployment", "Job", "JobRecord", "JobSummary", "SpecError", "load_job"} <= set(nebula.__all__)
    assert Deployment.__module__ == Job.__module__ == "nebula_common.sdk.api"


def test_a_spec_from_a_path_yaml_text_or_a_dict_loads_the_same_job() -> None:
    overrides = {"steps": 3, "edges.0.codec.forward": "int8"}
    text = EXAMPLE.read_text()
    from_path = load_job(EXAMPLE, overrides)
    from_str_path = load_job(str(EXAMPLE), overrides)
    from_text = load_job(text, overrides, base_dir=EXAMPLE.parent)
    from_dict = load_job(yaml.safe_load(text), overrides, base_dir=EXAMPLE.parent)
    for loaded in (from_str_path, from_text, from_dict):
        assert loaded.spec == from_path.spec and loaded.modules == from_path.modules
    assert from_path.spec.steps == 3 and from_path.spec.edge.codec.forward == "int8"
    assert yaml.safe_load(text)["steps"] == 40  # the caller's dict is not changed by the overrides


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("name: x\nsteps: [", "spec text: not valid YAML"),
        ("- just\n- a list\n", "spec text: the spec must be a mapping"),
        ({"name": "x"}, "spec dict: "),
        (42, "a spec is a path, YAML text or a dict, got int"),
        ("missing/job.yaml", "missing/job.yaml: cannot read"),
    ],
)
def test_a_bad_spec_is_named_without_a_traceback(spec: object, named: str) -> None:
    with pytest.raises(SpecError) as error:
        load_job(spec)  # type: ignore[arg-type]
    assert named in str(error.value)


def test_a_deployment_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    with pytest.raises(DeploymentFileError, match=r"cannot read deployment description .*deployment.json"):
        Deployment.from_run_dir(tmp_path)
    (tmp_path / "deployment.json").write_text(json.dumps({"clusters": {"a": {}}}))
    with pytest.raises(DeploymentFileError, match="deployment description is missing 'processes'"):
        Deployment.from_run_dir(tmp_path)
    creds = tmp_path / "creds.yaml"
    creds.write_text("a: {username: alice}\n")
    with pytest.raises(DeploymentFileError, match="a: needs username and password"):
        Deployment.open(tmp_path, credentials=creds)
