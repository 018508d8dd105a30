"""The one main of a generated file: write it, or (``--check``) fail if the file on disk is stale.

Used by ``tools/build_dashboard.py`` and ``tools/build_compose_3clusters.py``: each builds its text and
hands it here, with the file and the command that rewrites it (named in the stale message).
"""

from __future__ import annotations

import sys
from pathlib import Path


def write_or_check(out: Path, text: str, command: str, argv: list[str] | None = None) -> int:
    """Write ``text`` to ``out`` (0); with ``--check`` in argv, compare only: 1 and a message if stale."""
    if "--check" in (sys.argv if argv is None else argv):
        if not out.exists() or out.read_text() != text:
            print(f"{out} is stale: run `{command}`", file=sys.stderr)
            return 1
        return 0
    out.write_text(text)
    print(f"wrote {out}")
    return 0
