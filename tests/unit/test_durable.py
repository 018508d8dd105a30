"""Crash-safe writes (nebula_common.durable): content, exact modes, no torn or stray files."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from nebula_common.durable import atomic_write, create_new, fsync_dir

pytestmark = pytest.mark.timeout(60)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def leftovers(directory: Path) -> list[str]:
    """Temporary files a write left behind (they all start with a dot)."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


@pytest.fixture
def strict_umask() -> Iterator[None]:
    old = os.umask(0o077)
    yield
    os.umask(old)


def test_atomic_write_creates_with_exact_mode_and_parents(tmp_path: Path, strict_umask: None) -> None:
    target = tmp_path / "a" / "b" / "ca.crt"
    atomic_write(target, b"cert", mode=0o644)
    assert target.read_bytes() == b"cert"
    assert mode_of(target) == 0o644  # the umask did not strip the public bits
    assert leftovers(target.parent) == []


def test_atomic_write_replaces_content_and_mode(tmp_path: Path) -> None:
    target = tmp_path / "grants.json"
    atomic_write(target, b"old", mode=0o644)
    atomic_write(target, b"new" * 100_000, mode=0o600)
    assert target.read_bytes() == b"new" * 100_000
    assert mode_of(target) == 0o600
    assert leftovers(tmp_path) == []


def test_atomic_write_replaces_a_symlink_not_its_target(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    link = tmp_path / "key.pem"
    link.symlink_to(victim)
    atomic_write(link, b"key", mode=0o600)
    assert victim.read_bytes() == b"precious"
    assert not link.is_symlink() and link.read_bytes() == b"key"


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp_file(tmp_path: Path) -> None:
    """A real write failure (file size limit hit mid-write) must not touch the file in place."""
    target = tmp_path / "crl.pem"
    atomic_write(target, b"old content", mode=0o640)
    script = textwrap.dedent(
        f"""
        import resource, signal
        from pathlib import Path
        from nebula_common.durable import atomic_write
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        try:
            atomic_write(Path({str(target)!r}), b"x" * 100_000, mode=0o600)
        except OSError as exc:
            print("failed", exc.errno)
        else:
            print("written")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == "failed"
    assert target.read_bytes() == b"old content"
    assert mode_of(target) == 0o640
    assert leftovers(tmp_path) == []


def test_a_failed_replace_leaves_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "seal.json"
    target.mkdir()
    (target / "keep").write_bytes(b"x")
    with pytest.raises(OSError):
        atomic_write(target, b"data", mode=0o600)
    assert (target / "keep").read_bytes() == b"x"
    assert leftovers(tmp_path) == []


def test_create_new_creates_once_and_never_overwrites(tmp_path: Path, strict_umask: None) -> None:
    target = tmp_path / "keys" / "signing-key.pem"
    assert create_new(target, b"first", mode=0o600) is True
    assert mode_of(target) == 0o600
    assert create_new(target, b"second", mode=0o644) is False
    assert target.read_bytes() == b"first"
    assert mode_of(target) == 0o600
    assert leftovers(target.parent) == []


def test_create_new_does_not_follow_a_planted_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    target = tmp_path / "audit-key.pem"
    target.symlink_to(victim)
    assert create_new(target, b"key", mode=0o600) is False
    assert victim.read_bytes() == b"precious"


def test_racing_creators_agree_on_one_winner(tmp_path: Path) -> None:
    target = tmp_path / "signing-key.pem"
    candidates = [f"key-{i}".encode() for i in range(16)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        created = list(pool.map(lambda data: create_new(target, data, mode=0o600), candidates))
    assert created.count(True) == 1
    assert target.read_bytes() == candidates[created.index(True)]
    assert leftovers(tmp_path) == []


def test_fsync_dir_refuses_a_missing_directory(tmp_path: Path) -> None:
    fsync_dir(tmp_path)
    with pytest.raises(FileNotFoundError):
        fsync_dir(tmp_path / "missing")
