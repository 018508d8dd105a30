"""constraints.txt, the lock that `make install` and the image install with, stays complete and portable.

A dependency added to pyproject.toml without `make lock` would install at whatever version the index
has that day; a platform-specific pin (a torch local tag such as ``+cpu``, CUDA packages) would make
the install fail on another Linux machine. Both are caught here, before a fresh machine finds them.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints.txt"
PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s;+]+)$")


def _pins() -> dict[str, str]:
    """Canonical name -> pinned version, failing on any line that is not a plain ``name==version``."""
    pins: dict[str, str] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        match = PIN.match(line)
        assert match, f"constraints.txt: not a plain, portable pin: {line!r}"
        pins[canonicalize_name(match["name"])] = match["version"]
    return pins


def _declared() -> list[Requirement]:
    """Every requirement of pyproject.toml: the runtime dependencies and those of every extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements: list[str] = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    return [Requirement(r) for r in requirements]


def _makefile_variable(name: str) -> str:
    match = re.search(rf"^{name} \?= ?(.*)$", (ROOT / "Makefile").read_text(), flags=re.MULTILINE)
    assert match, f"Makefile defines no {name}"
    return match[1].strip()


def test_every_declared_dependency_is_locked_except_torch() -> None:
    declared = _declared()
    pins = _pins()
    names = {canonicalize_name(r.name) for r in declared} - {"nebula", "torch"}
    missing = sorted(names - pins.keys())
    assert not missing, f"declared in pyproject.toml but not in constraints.txt (run `make lock`): {missing}"
    for requirement in declared:
        name = canonicalize_name(requirement.name)
        if name in names:
            assert requirement.specifier.contains(pins[name], prereleases=True), (
                f"constraints.txt pins {name}=={pins[name]}, outside pyproject's {requirement}"
            )


def test_lock_leaves_out_torch_and_platform_specific_packages() -> None:
    platform_specific = {n for n in _pins() if n in ("torch", "triton") or n.startswith("nvidia-")}
    assert not platform_specific, (
        f"pinned by TORCH_VERSION or CUDA-only, must not be locked: {platform_specific}"
    )


def test_make_install_and_the_image_use_the_lock_and_the_same_torch() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^CONSTRAINTS := constraints\.txt$", makefile, flags=re.MULTILINE)
    assert '$(BIN)/pip install --quiet -c $(CONSTRAINTS) -e ".[dev]"' in makefile
    assert _makefile_variable("TORCH_INDEX_URL") == "", "the CPU index is opt-in"
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert 'pip install -c constraints.txt ".[text]"' in dockerfile
    image_torch = re.search(r"^ARG TORCH_VERSION=(\S+)$", dockerfile, flags=re.MULTILINE)
    assert image_torch and image_torch[1] == _makefile_variable("TORCH_VERSION")
