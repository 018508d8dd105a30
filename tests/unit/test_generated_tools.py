"""The generated files' one "write, or --check freshness" main (tools/_generated.py) and its two users."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from _generated import write_or_check  # noqa: E402  (tools/ is not a package)


@pytest.mark.parametrize("tool", ["build_dashboard.py", "build_compose_3clusters.py"])
def test_both_generated_files_are_fresh(tool: str) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / tool), "--check"], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr


def test_check_names_the_stale_file_and_the_command_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "made.txt"
    assert write_or_check(out, "new\n", "python tools/make.py", ["--check"]) == 1
    assert not out.exists()
    out.write_text("old\n")
    assert write_or_check(out, "new\n", "python tools/make.py", ["--check"]) == 1
    assert out.read_text() == "old\n"
    assert f"{out} is stale: run `python tools/make.py`" in capsys.readouterr().err
    assert write_or_check(out, "new\n", "python tools/make.py", []) == 0
    assert out.read_text() == "new\n"
    assert write_or_check(out, "new\n", "python tools/make.py", ["--check"]) == 0
