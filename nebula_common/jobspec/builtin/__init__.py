"""Jobs that ship with Nebula (the demo's), as ordinary spec + stage modules."""

from pathlib import Path

BUILTIN_DIR = Path(__file__).resolve().parent


def builtin_spec(name: str) -> Path:
    """Path of a built-in job's spec, e.g. ``builtin_spec("numbers")``."""
    path = BUILTIN_DIR / name / "job.yaml"
    if not path.is_file():
        available = sorted(p.parent.name for p in BUILTIN_DIR.glob("*/job.yaml"))
        raise FileNotFoundError(f"no built-in job {name!r}; available: {', '.join(available)}")
    return path
