"""Parsing Python source (stage modules, declarations, quoted strings) from any thread.

CPython 3.11 keeps the counter that ``ast.parse`` uses while it builds the tree's Python objects in
interpreter-wide state, not per call (gh-106905; 3.13 moved it onto the C stack). When a garbage
collection inside one thread's ``ast.parse`` runs Python finalizers and the interpreter switches to
another thread that is parsing too, the counter goes wrong and one of them raises
``SystemError: AST constructor recursion depth mismatch``. A trainer validates the stage modules of
concurrent ``AssignStage`` calls on gRPC's thread pool, so every parse in Nebula goes through one
process-wide lock here. Parses are small (a stage module is at most a few hundred KiB) and rare (once
per assignment or spec load), so the lock costs nothing measurable.
"""

from __future__ import annotations

import ast
import threading
from typing import Any

_PARSE_LOCK = threading.Lock()


def parse(source: str | bytes, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse`` of a module under the process-wide lock; raises what ``ast.parse`` raises."""
    with _PARSE_LOCK:
        return ast.parse(source, filename=filename)


def literal(text: str) -> Any:
    """``ast.literal_eval`` of a string, its parse under the same lock."""
    with _PARSE_LOCK:
        tree = ast.parse(text.lstrip(" \t"), mode="eval")
    return ast.literal_eval(tree)
