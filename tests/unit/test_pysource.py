"""Parsing Python from several threads at once: CPython 3.11's AST constructor counter is shared."""

from __future__ import annotations

import ast
import gc
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nebula_common import pysource

ROOT = Path(__file__).resolve().parents[2]
SOURCE = "\n".join(f"def f{i}(a):\n    return [x * a for x in range({i}) if x % 3 == 1]" for i in range(100))


@pytest.fixture
def gil_handed_over_inside_every_collection() -> Iterator[None]:
    """A collection during a parse runs Python code that gives the GIL away, as a finalizer can."""

    def hand_over(_phase: str, _info: dict[str, int]) -> None:
        time.sleep(0)

    threshold = gc.get_threshold()
    gc.set_threshold(10)
    gc.callbacks.append(hand_over)
    try:
        yield
    finally:
        gc.callbacks.remove(hand_over)
        gc.set_threshold(*threshold)


def _parse_from_threads(parse: Callable[[str], object], threads: int = 3, rounds: int = 20) -> list[str]:
    errors: list[str] = []

    def work() -> None:
        try:
            for _ in range(rounds):
                parse(SOURCE)
        except SystemError as exc:  # the 3.11 failure: "AST constructor recursion depth mismatch"
            errors.append(str(exc))

    workers = [threading.Thread(target=work, name=f"parse-{n}") for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
        assert not worker.is_alive(), f"{worker.name} still parsing after 60 s"
    return errors


@pytest.mark.usefixtures("gil_handed_over_inside_every_collection")
def test_concurrent_parses_build_every_tree() -> None:
    assert _parse_from_threads(pysource.parse) == []
    tree = pysource.parse(SOURCE)
    assert [node.name for node in tree.body if isinstance(node, ast.FunctionDef)][:2] == ["f0", "f1"]


@pytest.mark.usefixtures("gil_handed_over_inside_every_collection")
def test_literals_parse_under_the_same_lock() -> None:
    assert _parse_from_threads(lambda _source: pysource.literal('  "caf\\u00e9"')) == []
    assert pysource.literal('\t"caf\\u00e9"') == "café"
    with pytest.raises(ValueError):
        pysource.literal("__import__('os')")


def test_no_product_module_parses_outside_the_lock() -> None:
    """``ast.parse`` (or ``ast.literal_eval`` of text) only in pysource: trainers parse on many threads."""
    offenders = []
    product = [*ROOT.joinpath("nebula_common").rglob("*.py"), *ROOT.joinpath("services").rglob("*.py")]
    for path in sorted(product):
        if path.name == "pysource.py":
            continue
        for node in ast.walk(pysource.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if not (isinstance(node.func.value, ast.Name) and node.func.value.id == "ast"):
                continue
            parses_text = node.func.attr == "literal_eval" and not isinstance(node.args[0], ast.Attribute)
            if node.func.attr == "parse" or parses_text:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: ast.{node.func.attr}")
    assert offenders == [], "parse through nebula_common.pysource instead: " + ", ".join(offenders)
