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
    """One package whose Spanish catalogues join the corpus, pinned to one version so that every machine
    builds the same corpus (Debian's security updates otherwise change it under a committed table)."""

    kind: str  # "pypi" or "deb"
    name: str  # requirement with its ``==`` pin (pypi) or package name (deb)
    version: str = ""  # deb: the archive version (``apt-get download name=version``)

    @property
    def requirement(self) -> str:
        """What the client is asked for: the pinned requirement, or ``name=version`` for apt."""
        return f"{self.name}={self.version}" if self.kind == "deb" else self.name

    def archive_matches(self, archive: str) -> bool:
        """Whether a cached archive is this pin's (apt names an epoch ``1:`` as ``1%3a``)."""
        if self.kind != "deb":
            return True
        return archive.startswith(f"{self.name}_{self.version.replace(':', '%3a')}_")


SOURCES = (
    Source("pypi", "Django==5.2.19"),
    Source("pypi", "wagtail==8.0.1"),
    Source("pypi", "plone.app.locales==7.0.4"),
    Source("pypi", "Sphinx==8.2.3"),
    Source("pypi", "Weblate==5.14.3"),
    Source("deb", "git", "1:2.39.5-0+deb12u3"),
    Source("deb", "binutils-common", "2.40-2"),
    Source("deb", "postgresql-15", "15.18-0+deb12u1"),
    Source("deb", "postgresql-client-15", "15.18-0+deb12u1"),
    Source("deb", "libgtk-3-common", "3.24.38-2~deb12u3"),
    Source("deb", "libgtk2.0-common", "2.24.33-2+deb12u1"),
    Source("deb", "libgtk-4-common", "4.8.3+ds-2+deb12u1"),
    Source("deb", "gnome-control-center-data", "1:43.6-2~deb12u1"),
    Source("deb", "nautilus-data", "43.2-1"),
    Source("deb", "evolution-data-server-common", "3.46.4-2"),
    Source("deb", "gnupg-l10n", "2.2.40-1.1+deb12u2"),
    Source("deb", "libc-l10n", "2.36-9+deb12u14"),
    Source("deb", "coreutils", "9.1-1"),
    Source("deb", "libglib2.0-data", "2.74.6-2+deb12u9"),
    Source("deb", "dpkg", "1.21.23"),
    Source("deb", "xkb-data", "2.35.1-1"),
    Source("deb", "shared-mime-info", "2.2-1"),
    Source("deb", "gettext", "0.21-12"),
    Source("deb", "appstream", "0.16.1-2+b1"),
    Source("deb", "iso-codes", "4.15.0-1"),
    Source("deb", "wget", "1.21.3-1+deb12u1"),
    Source("deb", "bash", "5.2.15-2+b13"),
    Source("deb", "libreoffice-l10n-es", "4:7.4.7-1+deb12u14"),
    Source("deb", "vlc-l10n", "3.0.23-0+deb12u1"),
    Source("deb", "inkscape", "1.2.2-2+b1"),
    Source("deb", "gnucash-common", "1:4.13-1"),
    Source("deb", "evolution-common", "3.46.4-2+deb12u1"),
    Source("deb", "pidgin-data", "2.14.12-1"),
    Source("deb", "darktable", "4.2.1-4"),
    Source("deb", "cinnamon-l10n", "5.6.1-2"),
    Source("deb", "audacity-data", "3.2.4+dfsg-1"),
    Source("deb", "claws-mail-i18n", "4.1.1-2"),
    Source("deb", "gnumeric-common", "1.12.55-1"),
    Source("deb", "util-linux-locales", "2.38.1-5+deb12u3"),
    Source("deb", "filezilla-common", "3.63.0-1+deb12u3"),
    Source("deb", "hexchat-common", "2.16.1-1"),
    Source("deb", "geany-common", "1.38-1"),
    Source("deb", "shotwell-common", "0.30.17-1"),
    Source("deb", "libsane-common", "1.2.1-2"),
    Source("deb", "thunar-data", "4.18.4-1"),
    Source("deb", "gnome-software-common", "43.5-1~deb12u2"),
    Source("deb", "gnome-disk-utility", "43.0-1"),
    Source("deb", "aptitude-common", "0.8.13-5"),
    Source("deb", "synaptic", "0.91.3"),
    Source("deb", "gedit-common", "44.2-1"),
    Source("deb", "gnome-shell-common", "43.9-0+deb12u2"),
    Source("deb", "poedit-common", "3.2.2-1"),
    Source("deb", "rhythmbox-data", "3.4.6-2"),
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
    if found and source.archive_matches(found[0].name):
        return found[0]
    for stale in found:  # another version than the pin's, from an older tree: fetch the pinned one
        stale.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    if source.kind == "pypi":
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(folder)]
        _run([*pip, source.requirement], folder)
    elif source.kind == "deb":
        if shutil.which("apt-get") is None:
            raise CorpusError(f"{source.name}: a Debian package, but apt-get is not on this machine")
        command = ["apt-get", "download", "-o", "APT::Sandbox::User=root", source.requirement]
        try:
            _run(command, folder)
        except CorpusError:
            # A fresh machine (CI) may have no package lists yet: read them once, then try again.
            _run(["apt-get", "update", "-qq"], folder)
            try:
                _run(command, folder)
            except CorpusError as exc:
                raise CorpusError(
                    f"{exc} (the pinned version {source.version} of {source.name} is not in this machine's "
                    "package lists: a new pin in corpus.SOURCES changes the corpus and the table)"
                ) from None
    else:
        raise CorpusError(f"unknown source kind {source.kind!r}")
    found = sorted(folder.iterdir())
    if len(found) != 1 or not source.archive_matches(found[0].name):
        names = [path.name for path in found]
        raise CorpusError(f"{source.requirement}: expected its one archive in {folder}, found {names}")
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


def _pinned(manifest: dict, sources: tuple[Source, ...] = SOURCES) -> bool:
    """Whether a cached corpus was built from exactly these sources at their pinned versions."""
    built = {(entry["kind"], entry["name"]): entry["archive"] for entry in manifest.get("sources", [])}
    return len(built) == len(sources) and all(
        (s.kind, s.name) in built and s.archive_matches(built[(s.kind, s.name)]) for s in sources
    )


def load(cache: Path, evaluated: str) -> tuple[dict, list[Pair], list[Pair]]:
    """The manifest, the training split and the ``evaluated`` one ("dev" to tune, "test" to report),
    building the corpus first when the cache has none."""
    if evaluated not in ("dev", "test"):
        raise CorpusError(f"the evaluated split is 'dev' or 'test', not {evaluated!r}")
    folder = cache / "corpus"
    manifest_path = folder / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else None
    if (
        manifest is None
        or not all(f"{name}.tsv" in manifest["sha256"] for name in SPLITS)
        or not _pinned(manifest)
    ):
        manifest = build(cache)  # none yet, the two-way split's, or other versions': rebuild
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
