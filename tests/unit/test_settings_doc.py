"""docs/settings.md is the settings classes as they are: fresh, and every setting explained."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_settings_page_is_generated_from_the_settings_classes() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "build_settings_doc.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def test_every_setting_says_what_it_is_for() -> None:
    rows = [
        line
        for line in (ROOT / "docs" / "settings.md").read_text().splitlines()
        if line.startswith("| `NEBULA_")
    ]
    assert len(rows) >= 100
    cells = [[cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip().strip("|"))] for row in rows]
    assert all(len(row) == 4 for row in cells), [row for row in cells if len(row) != 4]
    undocumented = [row[0] for row in cells if not row[3]]
    assert not undocumented, f"settings without a description (Field(description=...)): {undocumented}"
