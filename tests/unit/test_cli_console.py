"""Every rich console of the CLI and SDK comes from ``nebula_common/cli/console.py`` (emoji off)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nebula_common.cli.console import new_console, print_error

ROOT = Path(__file__).resolve().parents[2]
FACTORY = ROOT / "nebula_common" / "cli" / "console.py"
MADE = re.compile(r"\bConsole\(")


def test_no_console_is_made_outside_the_factory() -> None:
    made = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for package in ("nebula_common", "nebula", "services", "tools", "bench", "docker")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path != FACTORY
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if MADE.search(line)
    ]
    assert not made, "make rich consoles with nebula_common.cli.console.new_console():\n" + "\n".join(made)


def test_the_grep_finds_a_console_made_by_hand() -> None:
    assert MADE.search("    console = Console(stderr=True)")
    assert MADE.search("x = rich.console.Console()")
    assert not MADE.search("console = new_console()")
    assert not MADE.search("def show(console: Console) -> None:")


def test_a_fingerprint_is_printed_to_the_letter(capsys: pytest.CaptureFixture[str]) -> None:
    fingerprint = "SHA256:AB:CD:AB:01"  # ':AB:' is an emoji code to rich by default
    new_console().print(fingerprint, soft_wrap=True)
    print_error(f"wrong fingerprint {fingerprint} [x]")
    out, err = capsys.readouterr()
    assert out == f"{fingerprint}\n"
    assert err == f"error: wrong fingerprint {fingerprint} [x]\n"
