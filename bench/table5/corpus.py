"""The Table 5 corpus: Spanish-English pairs from the gettext catalogues that Debian and PyPI packages ship.

Why these: every pair is a human translation that a package ships under a free
licence, reachable with the ordinary clients (``pip download --no-deps``,
``apt-get download``), so any machine rebuilds the same corpus; Django's
catalogues alone (today's ABNet data) give < 1k short pairs, too few to tell
1 BLEU apart. The packages are fetched into ``--cache`` (kept between runs),
their Spanish ``.mo`` catalogues (``es`` and regional ``es_*``) parsed by
``nebula_common.zoo.catalogues``, cleaned, deduplicated and split into train, dev
and test with no near copy of a dev or test pair in training
(``nebula_common.zoo.splits``).

Writes ``<cache>/corpus/{train,dev,test}.tsv`` (``spanish<TAB>english``) and
``manifest.json``: every source with its package version, file digest and the
pairs it gave, the counts and the SHA-256 of every split.

    .venv/bin/python bench/table5/corpus.py --cache .cache/table5
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from nebula_common.zoo.catalogues import CatalogueError, Pair, clean_pairs, parse_mo
from nebula_common.zoo.splits import NEAR_RATIO, split

MAX_WORDS = 16
DEV_FRACTION = 0.03
TEST_FRACTION = 0.06
"""Of the groups, before near copies move to training (about a quarter of the drawn pairs do)."""
SEED = 13
SPLITS = ("train", "dev", "test")


@dataclass(frozen=True)
class Source:
    kind: str  # "pypi" or "deb"
    name: str  # requirement (pypi, pinned) or package name (deb, the archive's current version)


SOURCES = (
    Source("pypi", "Django==5.2.19"),
    Source("pypi", "wagtail==8.0.1"),
    Source("pypi", "plone.app.locales==7.0.4"),
    Source("pypi", "Sphinx==8.2.3"),
    Source("pypi", "Weblate==5.14.3"),
    Source("deb", "git"),
    Source("deb", "binutils-common"),
    Source("deb", "postgresql-15"),
    Source("deb", "postgresql-client-15"),
    Source("deb", "libgtk-3-common"),
    Source("deb", "libgtk2.0-common"),
    Source("deb", "libgtk-4-common"),
    Source("deb", "gnome-control-center-data"),
    Source("deb", "nautilus-data"),
    Source("deb", "evolution-data-server-common"),
    Source("deb", "gnupg-l10n"),
    Source("deb", "libc-l10n"),
    Source("deb", "coreutils"),
    Source("deb", "libglib2.0-data"),
    Source("deb", "dpkg"),
    Source("deb", "xkb-data"),
    Source("deb", "shared-mime-info"),
    Source("deb", "gettext"),
    Source("deb", "appstream"),
    Source("deb", "iso-codes"),
    Source("deb", "wget"),
    Source("deb", "bash"),
    Source("deb", "libreoffice-l10n-es"),
    Source("deb", "vlc-l10n"),
    Source("deb", "inkscape"),
    Source("deb", "gnucash-common"),
    Source("deb", "evolution-common"),
    Source("deb", "pidgin-data"),
    Source("deb", "darktable"),
    Source("deb", "cinnamon-l10n"),
    Source("deb", "audacity-data"),
    Source("deb", "claws-mail-i18n"),
    Source("deb", "gnumeric-common"),
    Source("deb", "util-linux-locales"),
    Source("deb", "filezilla-common"),
    Source("deb", "hexchat-common"),
    Source("deb", "geany-common"),
    Source("deb", "shotwell-common"),
    Source("deb", "libsane-common"),
    Source("deb", "thunar-data"),
    Source("deb", "gnome-software-common"),
    Source("deb", "gnome-disk-utility"),
    Source("deb", "aptitude-common"),
    Source("deb", "synaptic"),
    Source("deb", "gedit-common"),
    Source("deb", "gnome-shell-common"),
    Source("deb", "poedit-common"),
    Source("deb", "rhythmbox-data"),
)


class CorpusError(RuntimeError):
    """A source could not be fetched or read; the message names it and the command that failed."""


def _run(command: list[str], cwd: Path) -> None:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise CorpusError(f"{' '.join(command)} failed ({done.returncode}): {' / '.join(tail)}")


def fetch(source: Source, downloads: Path) -> Path:
    """The source's archive in ``downloads`` (fetched once; a later run reuses it)."""
    folder = downloads / source.kind / source.name.replace("/", "_")
    found = sorted(folder.glob("*.whl")) + sorted(folder.glob("*.tar.gz")) + sorted(folder.glob("*.deb"))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    if source.kind == "pypi":
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(folder)]
        _run([*pip, source.name], folder)
    elif source.kind == "deb":
        if shutil.which("apt-get") is None:
            raise CorpusError(f"{source.name}: a Debian package, but apt-get is not on this machine")
        command = ["apt-get", "download", "-o", "APT::Sandbox::User=root", source.name]
        try:
            _run(command, folder)
        except CorpusError:
            # A fresh machine (CI) may have no package lists yet: read them once, then try again.
            _run(["apt-get", "update", "-qq"], folder)
            _run(command, folder)
    else:
        raise CorpusError(f"unknown source kind {source.kind!r}")
    found = sorted(folder.iterdir())
    if len(found) != 1:
        raise CorpusError(f"{source.name}: expected one archive in {folder}, found {len(found)}")
    return found[0]


def _spanish_catalogue(path: str) -> bool:
    parts = PurePosixPath(path).parts
    return (
        path.endswith(".mo")
        and len(parts) >= 3
        and parts[-2] == "LC_MESSAGES"
        and (parts[-3] == "es" or parts[-3].startswith(("es_", "es@")))
    )


def catalogues(archive: Path) -> dict[str, bytes]:
    """Every Spanish ``.mo`` inside a wheel, sdist or .deb, by its path in the archive."""
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as wheel:
            return {n: wheel.read(n) for n in sorted(wheel.namelist()) if _spanish_catalogue(n)}
    if archive.name.endswith(".tar.gz"):
        with tarfile.open(archive) as sdist:
            members = [m for m in sdist.getmembers() if m.isfile() and _spanish_catalogue(m.name)]
            return {m.name: sdist.extractfile(m).read() for m in sorted(members, key=lambda m: m.name)}
    if archive.suffix == ".deb":
        with tempfile.TemporaryDirectory() as tmp:
            _run(["dpkg-deb", "-x", str(archive), tmp], Path(tmp))
            root = Path(tmp)
            return {
                str(p.relative_to(root)): p.read_bytes()
                for p in sorted(root.rglob("*.mo"))
                if p.is_file() and not p.is_symlink() and _spanish_catalogue(str(p.relative_to(root)))
            }
    raise CorpusError(f"{archive}: not a wheel, sdist or .deb")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tsv(pairs: list[Pair]) -> bytes:
    return "".join(f"{p.spanish}\t{p.english}\n" for p in pairs).encode("utf-8")


def build(cache: Path, sources: tuple[Source, ...] = SOURCES) -> dict:
    """Fetch, parse, clean, split; write the corpus and its manifest; return the manifest."""
    # absolute: the fetch commands run inside the download folder (a relative -d would nest the path)
    downloads, out = (cache / "downloads").resolve(), cache / "corpus"
    entries: list[tuple[str, str]] = []
    described = []
    for source in sources:
        archive = fetch(source, downloads)
        found = catalogues(archive)
        if not found:
            raise CorpusError(f"{source.name}: no Spanish .mo catalogue in {archive.name}")
        own: list[tuple[str, str]] = []
        for path, data in found.items():
            try:
                own += parse_mo(data, f"{archive.name}:{path}")
            except CatalogueError as exc:
                raise CorpusError(str(exc)) from exc
        entries += own
        described.append(
            {
                "kind": source.kind,
                "name": source.name,
                "archive": archive.name,
                "sha256": _digest(archive.read_bytes()),
                "catalogues": len(found),
                "entries": len(own),
                "clean_pairs": len(clean_pairs(own, MAX_WORDS)),
            }
        )
        print(f"{source.name}: {len(found)} catalogues, {len(own)} entries", file=sys.stderr, flush=True)
    pairs = clean_pairs(entries, MAX_WORDS)
    parts = split(pairs, DEV_FRACTION, TEST_FRACTION, SEED)
    out.mkdir(parents=True, exist_ok=True)
    files = {f"{name}.tsv": _tsv(getattr(parts, name)) for name in SPLITS}
    for name, data in files.items():
        (out / name).write_bytes(data)
    for stale in ("held_out.tsv",):  # the two-way split's file: no reader may pick it up by mistake
        (out / stale).unlink(missing_ok=True)
    manifest = {
        "max_words": MAX_WORDS,
        "dev_fraction": DEV_FRACTION,
        "test_fraction": TEST_FRACTION,
        "near_ratio": NEAR_RATIO,
        "seed": SEED,
        "entries": len(entries),
        "pairs": len(pairs),
        **{name: len(getattr(parts, name)) for name in SPLITS},
        "moved_to_train": parts.moved,
        "sha256": {name: _digest(data) for name, data in files.items()},
        "sources": described,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_split(path: Path) -> list[Pair]:
    """One split file as pairs (what the benchmark loads)."""
    pairs = []
    for number, line in enumerate(io.StringIO(path.read_text(encoding="utf-8")), start=1):
        spanish, tab, english = line.rstrip("\n").partition("\t")
        if not tab or not spanish or not english:
            raise CorpusError(f"{path}:{number}: not 'spanish<TAB>english'")
        pairs.append(Pair(spanish=spanish, english=english))
    return pairs


def load(cache: Path, evaluated: str) -> tuple[dict, list[Pair], list[Pair]]:
    """The manifest, the training split and the ``evaluated`` one ("dev" to tune, "test" to report),
    building the corpus first when the cache has none."""
    if evaluated not in ("dev", "test"):
        raise CorpusError(f"the evaluated split is 'dev' or 'test', not {evaluated!r}")
    folder = cache / "corpus"
    manifest_path = folder / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else None
    if manifest is None or not all(f"{name}.tsv" in manifest["sha256"] for name in SPLITS):
        manifest = build(cache)  # none yet, or the two-way split's: rebuild from the cached archives
    return manifest, read_split(folder / "train.tsv"), read_split(folder / f"{evaluated}.tsv")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path(".cache") / "table5")
    args = parser.parse_args()
    try:
        manifest = build(args.cache)
    except CorpusError as exc:
        sys.exit(f"corpus: {exc}")
    summary = {k: manifest[k] for k in ("entries", "pairs", *SPLITS, "moved_to_train")}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
