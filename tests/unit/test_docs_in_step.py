"""The docs name exactly the services and CLI commands the code has.

A service added to ``[project.scripts]`` or a command added to the Typer app is easy to ship without a
line in the README; a command renamed or removed leaves a README row that no longer works. Both are
caught here, from the same sources the installed ``nebula*`` entry points come from.
"""

from __future__ import annotations

import itertools
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from nebula_common.cli.app import app

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
DOCKER_README = ROOT / "docker" / "README.md"
WORD = re.compile(r"^[a-z][a-z0-9-]*$")


def _services() -> list[str]:
    """The long-running ``nebula-*`` services, from pyproject.toml's console scripts."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    services = sorted(name for name in scripts if name.startswith("nebula-"))
    assert services, "no nebula-* console scripts in pyproject.toml"
    return services


def _paragraph(text: str, starts_with: str) -> str:
    """The paragraph (up to the next blank line) that begins with ``starts_with``."""
    start = text.index(starts_with)
    end = text.find("\n\n", start)
    return text[start : end if end >= 0 else len(text)]


def _commands(command: Any, path: tuple[str, ...]) -> Iterator[str]:
    """Every runnable command path under ``command`` (a click command or group), hidden ones left out.

    Typer ships its own copy of click, so a group is recognised by its ``commands`` mapping rather
    than by ``isinstance(click.Group)``.
    """
    subcommands = getattr(command, "commands", None)
    if isinstance(subcommands, dict):
        for name, sub in subcommands.items():
            if not sub.hidden:
                yield from _commands(sub, (*path, name))
    else:
        yield " ".join(path)


def _cli_commands() -> set[str]:
    return set(_commands(typer.main.get_command(app), ("nebula",)))


def _readme_cli_rows() -> dict[str, str]:
    """Command path -> the README table row documenting it.

    A row documents the leading lowercase words of its first code span, up to the first argument or
    option; ``a\\|b`` stands for both ``a`` and ``b`` (``nebula data upload\\|import …``). Table
    headers (the line before ``|---``) are not rows.
    """
    lines = README.read_text().splitlines()
    rows: dict[str, str] = {}
    for line, following in itertools.pairwise([*lines, ""]):
        match = re.match(r"^\| `(nebula [^`]*)`", line)
        if not match or following.startswith("|-"):
            continue
        choices: list[list[str]] = []
        for token in match[1].split():
            alternatives = token.split("\\|")
            if not all(WORD.match(word) for word in alternatives):
                break
            choices.append(alternatives)
        for words in itertools.product(*choices):
            rows[" ".join(words)] = line
    assert rows, "found no CLI table rows in README.md"
    return rows


def test_readme_lists_every_service() -> None:
    listed = _paragraph(README.read_text(), "Services run as")
    missing = [s for s in _services() if f"`{s}`" not in listed]
    assert not missing, f"README's service list lacks {missing}"


def test_architecture_lists_every_service_and_its_start_order() -> None:
    text = ARCHITECTURE.read_text()
    table = _paragraph(text, "| service | binary / module |")
    missing = [s for s in _services() if f"`{s}`" not in table]
    assert not missing, f"docs/architecture.md's service table lacks {missing}"
    order = _paragraph(text, "`nebula_common/launcher` starts")
    for what in ("per cluster, ", "Start order: "):
        start = order.index(what)
        end = re.compile(r"\.\s").search(order, start)
        sentence = order[start : end.start() if end else len(order)]
        absent = [s for s in _services() if not re.search(rf"\b{s.removeprefix('nebula-')}", sentence)]
        assert not absent, f"docs/architecture.md's local deployment ({what.strip()!r}) leaves out {absent}"


def test_docker_readme_lists_every_service_the_image_runs() -> None:
    listed = _paragraph(DOCKER_README.read_text(), "One image")
    missing = [s for s in _services() if f"`{s}`" not in listed]
    assert not missing, f"docker/README.md's list of processes lacks {missing}"


def test_every_cli_command_has_a_readme_row() -> None:
    missing = sorted(_cli_commands() - _readme_cli_rows().keys())
    assert not missing, f"commands without a row in README's CLI tables: {missing}"


def test_every_readme_row_names_a_command_that_exists() -> None:
    commands = _cli_commands()
    stale = {path: row for path, row in _readme_cli_rows().items() if path not in commands}
    assert not stale, f"README rows naming no command: {stale}"
