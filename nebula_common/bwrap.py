"""What every bubblewrap box of Nebula's is built from: the host's system files and Nebula's code, read-only.

Two boxes use it: the trainer's box around each stage (``services/trainer/sandbox.py``) and the
launcher's box around each service of a local deployment (``launcher/service_box.py``). Both start
from an empty root and add only what a Python process of Nebula's needs to run, so a path that is
not named here (the run directory, the repository's ``runs/``, home directories) does not exist
inside.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

SYSTEM_ETC = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/localtime",
    "/etc/nsswitch.conf",
)
"""The few files of /etc the dynamic loader and the C library read; never all of /etc (shadow, ssh)."""


def system_binds(etc: tuple[str, ...] = SYSTEM_ETC) -> list[str]:
    """/usr and the usual top-level links into it (merged /usr), as the host has them, and ``etc``."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        path = Path(top)
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), top]
        elif path.is_dir():
            args += ["--ro-bind", top, top]
    for name in etc:
        if Path(name).exists():
            args += ["--ro-bind", name, name]
    return args


def code_roots(packages: tuple[ModuleType, ...]) -> list[Path]:
    """What a Nebula process imports: the interpreter's prefix, the environment's and the given packages.

    Each package's own directory only, never the repository around it (whose ``runs/`` holds
    deployments' keys).
    """
    roots = {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()}
    for package in packages:
        roots.add(Path(package.__file__ or "").resolve().parent)
    for entry in sys.path:
        path = Path(entry or ".").resolve()
        if "site-packages" in path.parts or "dist-packages" in path.parts:
            roots.add(path)
    return sorted(root for root in roots if root.exists())
