"""Where an audit log's segments live, and how rotation moves them (``AuditLog`` rotates).

``<log>`` is the file being written; ``<log>.1`` the newest rotated segment .. ``<log>.<kept>`` the
oldest kept. Each segment has its external seal beside it (``<segment>.seal``).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["seal_path_for", "segment_path", "segments", "shift_segments"]


def seal_path_for(log_path: Path) -> Path:
    """Where the external seal of ``log_path`` lives: same directory, ``.seal`` appended."""
    return log_path.with_name(log_path.name + ".seal")


def segment_path(log_path: Path, index: int) -> Path:
    """Rotated segment ``index`` of ``log_path`` (1: the newest); 0 is the file being written."""
    return log_path if index == 0 else log_path.with_name(f"{log_path.name}.{index}")


def segments(log_path: Path) -> list[Path]:
    """The segments of ``log_path`` that exist, oldest first, the current file last (if it exists)."""
    found = []
    index = 1
    while segment_path(log_path, index).exists():
        found.append(segment_path(log_path, index))
        index += 1
    found.reverse()
    if log_path.exists():
        found.append(log_path)
    return found


def shift_segments(log_path: Path, kept: int) -> None:
    """Drop segment ``kept`` and move every other segment (and the current file) up by one, seals too."""
    oldest = segment_path(log_path, kept)
    for stale in (oldest, seal_path_for(oldest)):
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
    for index in range(kept - 1, -1, -1):
        source, target = segment_path(log_path, index), segment_path(log_path, index + 1)
        for old, new in ((source, target), (seal_path_for(source), seal_path_for(target))):
            with contextlib.suppress(FileNotFoundError):
                os.replace(old, new)
