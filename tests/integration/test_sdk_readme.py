"""The README's SDK example runs as written, in this process, against the shared real deployment.

The code block is taken from README.md (the first ``python`` block under "### The SDK"), so the
example a newcomer copies is the one that is tested; only ``NEBULA_RUN_DIR`` points it at this
test session's deployment, and the working directory is the repository root (its spec path).
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from nebula_common.launcher import LocalDeployment

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]


def readme_sdk_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### The SDK\n") :]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, "README's SDK section has no python block"
    return match[1]


def test_the_readme_sdk_example_runs(deployment: LocalDeployment, monkeypatch: pytest.MonkeyPatch) -> None:
    code = readme_sdk_example()
    assert code.startswith("import os\n\nfrom nebula import Deployment\n")  # one import of Nebula
    deployment.write_description(deployment.run_dir / "deployment.json")
    monkeypatch.setenv("NEBULA_RUN_DIR", str(deployment.run_dir))
    monkeypatch.chdir(ROOT)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md (SDK example)", "exec"), {"__name__": "readme_example"})
    lines = out.getvalue().splitlines()
    assert len(lines) == 4, lines
    first_id, state, *_ = lines[0].split()
    assert state == "SUCCEEDED" and first_id.startswith("digit-sum-"), lines[0]
    assert lines[1] == "{'forward': 2.0, 'backward': 4.0}", lines[1]  # fp16 and int8, this job's own bytes
    second_id, cancelled = lines[2].split()
    assert cancelled == "CANCELLED", lines[2]
    assert lines[3] == str([(first_id, "SUCCEEDED"), (second_id, "CANCELLED")]), lines[3]
