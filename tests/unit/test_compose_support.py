"""docker/compose_support.py, the part the container smokes share, on the real compose files.

The override file that lets a smoke run beside another deployment must move every published port of
every file by the offset (and only those), replace lists instead of appending to them, and point
every service at another image; the compose command carries the project and files; a wait that runs
out names what it waited for. (The smokes themselves run in `make smoke-*-containers`.)
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("compose_support", ROOT / "docker" / "compose_support.py")
assert _spec is not None and _spec.loader is not None
support = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("compose_support", support)
_spec.loader.exec_module(support)


class _Loader(yaml.SafeLoader):
    """Reads ``!override`` sequences as plain lists, remembering that they were tagged."""

    tagged: list[list[str]] = []


def _override(loader: yaml.SafeLoader, node: yaml.SequenceNode) -> list[str]:
    value = [str(v) for v in loader.construct_sequence(node)]
    _Loader.tagged.append(value)
    return value


_Loader.add_constructor("!override", _override)


def _published(files: tuple[str, ...]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for name in files:
        for service, body in yaml.safe_load((ROOT / name).read_text())["services"].items():
            if body.get("ports"):
                found[service] = [str(p) for p in body["ports"]]
    return found


@pytest.mark.parametrize(
    "files", [("docker/compose-3clusters.yml",), ("docker-compose.yml", "docker-compose.ranks.yml")]
)
def test_the_override_moves_every_published_port_and_the_image(
    files: tuple[str, ...], tmp_path: Path
) -> None:
    _Loader.tagged = []
    path = support.override_file(tmp_path, "localhost/nebula:other", 7, files)
    assert path is not None
    services = yaml.load(path.read_text(), Loader=_Loader)["services"]
    before = _published(files)
    assert before, files
    for service, ports in before.items():
        moved = services[service]["ports"]
        assert len(moved) == len(ports)
        for old, new in zip(ports, moved, strict=True):
            host, published, inner = old.rsplit(":", 2)
            assert new == f"{host}:{int(published) + 7}:{inner}"
    assert len(_Loader.tagged) == len(before), "every moved list replaces the file's, not appends"
    every = {s for f in files for s in yaml.safe_load((ROOT / f).read_text())["services"]}
    assert set(services) == every
    assert {body["image"] for body in services.values()} == {"localhost/nebula:other"}


def test_no_override_file_is_written_when_nothing_moves(tmp_path: Path) -> None:
    assert support.override_file(tmp_path, support.DEFAULT_IMAGE, 0, ("docker-compose.yml",)) is None
    assert not list(tmp_path.iterdir())


def test_the_compose_command_names_engine_project_and_files(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPOSE", "podman-compose --podman-args=-q")
    compose = support.Compose("nebula-x", ("docker/compose-3clusters.yml",), Path("/tmp/extra.yml"))
    assert compose.base == [
        "podman-compose", "--podman-args=-q", "-p", "nebula-x",
        "-f", str(ROOT / "docker/compose-3clusters.yml"), "-f", "/tmp/extra.yml",
    ]  # fmt: skip
    assert support.Compose(None, ("docker-compose.yml",)).base[2:] == ["-f", str(ROOT / "docker-compose.yml")]


def test_a_wait_that_runs_out_names_what_it_waited_for() -> None:
    started = time.monotonic()
    with pytest.raises(support.SmokeFailure, match=r"timed out after 0 s waiting for the moon"):
        support.wait(lambda: False, 0.2, "the moon")
    assert time.monotonic() - started < 5.0
    assert support.wait(lambda: True, 0.2, "nothing") < 1.0
