"""Table 5's corpus is pinned: every Debian package to the version the committed table was measured on,
a cached corpus of other versions is rebuilt, and a stale archive in the cache is never read as the pin's."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "table5"))

import corpus

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "bench" / "results" / "table5" / "corpus-manifest.json"
VLC = corpus.Source("deb", "vlc-l10n", "3.0.23-0+deb12u1")


@contextlib.contextmanager
def _apt_get(tmp_path: Path, script: str) -> Iterator[None]:
    """A stand-in ``apt-get`` (this shell ``script``) first on PATH: the fetch runs it as it runs apt's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    apt = bin_dir / "apt-get"
    apt.write_text("#!/bin/sh\n" + script)
    apt.chmod(0o755)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
        yield


def test_every_source_is_pinned_to_the_committed_manifests_archive() -> None:
    committed = {(e["kind"], e["name"]): e["archive"] for e in json.loads(COMMITTED.read_text())["sources"]}
    for source in corpus.SOURCES:
        assert (source.kind, source.name) in committed, f"{source.name} is not in {COMMITTED.name}"
        if source.kind == "deb":
            assert source.version, f"{source.name} has no pinned version"
            assert source.archive_matches(committed[(source.kind, source.name)]), source
        else:
            assert "==" in source.name, f"{source.name}: a PyPI source needs an == pin"
    assert len(committed) == len(corpus.SOURCES)
    assert corpus._pinned(json.loads(COMMITTED.read_text()))


def test_an_epoch_is_named_as_apt_names_it_and_other_versions_do_not_match() -> None:
    git = corpus.Source("deb", "git", "1:2.39.5-0+deb12u3")
    assert git.requirement == "git=1:2.39.5-0+deb12u3"
    assert git.archive_matches("git_1%3a2.39.5-0+deb12u3_amd64.deb")
    assert not git.archive_matches("git_1%3a2.39.5-0+deb12u4_amd64.deb")
    assert not git.archive_matches("git_1%3a2.39.5-0+deb12u3.1_amd64.deb")
    assert not corpus.Source("deb", "vlc-l10n", "3.0.23-0+deb12u1").archive_matches(
        "vlc-l10n_3.0.24-0+deb12u1_all.deb"
    )


def test_a_corpus_built_from_other_versions_is_not_taken_for_the_pinned_one() -> None:
    manifest = json.loads(COMMITTED.read_text())
    moved = [dict(e) for e in manifest["sources"]]
    vlc = next(e for e in moved if e["name"] == "vlc-l10n")
    vlc["archive"] = "vlc-l10n_3.0.24-0+deb12u1_all.deb"
    assert not corpus._pinned({**manifest, "sources": moved})
    assert not corpus._pinned({**manifest, "sources": moved[:-1]})


def test_a_cached_archive_of_another_version_is_replaced_not_read(tmp_path: Path) -> None:
    """The pinned fetch runs the real ``apt-get download``; here a stub apt-get on PATH records the request
    and writes the file it names, so the test needs no mirror."""
    folder = tmp_path / "downloads" / "deb" / "vlc-l10n"
    folder.mkdir(parents=True)
    (folder / "vlc-l10n_3.0.24-0+deb12u1_all.deb").write_bytes(b"newer")
    log = tmp_path / "apt.log"
    script = (
        f'echo "$@" >> {log}\n'
        "for last; do :; done\n"
        "name=${last%%=*}; version=${last#*=}\n"
        'printf pinned > "${name}_${version}_all.deb"\n'
    )
    with _apt_get(tmp_path, script):
        archive = corpus.fetch(VLC, tmp_path / "downloads")
    assert archive.name == "vlc-l10n_3.0.23-0+deb12u1_all.deb"
    assert archive.read_bytes() == b"pinned"
    assert [p.name for p in folder.iterdir()] == [archive.name]
    assert "vlc-l10n=3.0.23-0+deb12u1" in log.read_text()


def test_a_pin_gone_from_the_package_lists_stops_the_build_naming_it(tmp_path: Path) -> None:
    """apt-get refuses a version its lists no longer hold; the error names the pin and leaves no archive."""
    script = (
        'case "$1" in update) exit 0;; esac\n'
        "echo \"E: Version '3.0.23-0+deb12u1' for 'vlc-l10n' was not found\" >&2\nexit 100\n"
    )
    with _apt_get(tmp_path, script), pytest.raises(corpus.CorpusError) as raised:
        corpus.fetch(VLC, tmp_path / "downloads")
    message = str(raised.value)
    assert "vlc-l10n=3.0.23-0+deb12u1 failed (100)" in message and "was not found" in message
    assert "pinned version 3.0.23-0+deb12u1 of vlc-l10n" in message
    assert not list((tmp_path / "downloads").rglob("*.deb"))
