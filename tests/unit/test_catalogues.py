"""The Table 5 corpus pieces on real catalogues: .mo parsing, cleaning and dedup (the split: test_splits)."""

from __future__ import annotations

import itertools
import struct
from pathlib import Path

import pytest

from nebula_common.zoo.catalogues import CatalogueError, clean, clean_pairs, key, parse_mo
from nebula_common.zoo.text_data import catalogue_paths, parse_po


def _django(locale: str) -> Path:
    for path in catalogue_paths():
        if path.parts[-3] == locale and path.parent.parent.parent.parent.name == "conf":
            return path
    raise AssertionError(f"Django ships no conf/locale/{locale} catalogue")


@pytest.mark.parametrize("locale", ["es", "es_AR"])
def test_mo_parser_agrees_with_the_po_it_was_compiled_from(locale: str) -> None:
    po = _django(locale)
    from_mo = dict(parse_mo(po.with_suffix(".mo").read_bytes(), str(po)))
    # the .po parser keeps msgctxt apart and skips plurals too; a .mo has no fuzzy entries
    from_po = dict(parse_po(po))
    assert len(from_mo) > 200
    shared = from_mo.keys() & from_po.keys()
    assert len(shared) >= 0.95 * len(from_po)
    assert all(from_mo[k] == from_po[k] for k in shared if k not in _with_context(po))


def _with_context(po: Path) -> set[str]:
    """msgids that appear with a msgctxt (their translation depends on it, so dict views can differ)."""
    lines = po.read_text(encoding="utf-8").splitlines()
    return {
        nxt.partition(" ")[2].strip('"')
        for line, nxt in itertools.pairwise(lines)
        if line.startswith("msgctxt")
    }


def test_bad_catalogues_are_refused_by_name() -> None:
    real = (_django("es").with_suffix(".mo")).read_bytes()
    with pytest.raises(CatalogueError, match=r"x\.mo: not a \.mo file"):
        parse_mo(b"\x00" * 64, "x.mo")
    with pytest.raises(CatalogueError, match=r"y\.mo: .* too short"):
        parse_mo(real[:10], "y.mo")
    count = struct.unpack_from("<I", real, 8)[0]
    truncated = real[: len(real) // 2]
    with pytest.raises(CatalogueError, match=r"z\.mo: entry .* past the end"):
        parse_mo(truncated, "z.mo")
    assert count > 0


def test_cleaning_keeps_sentences_and_drops_code() -> None:
    assert clean("_Open  file", 16) == "Open file"
    assert clean("&Guardar como…", 16) == "Guardar como…"
    assert clean("Rock & roll", 16) == "Rock & roll"
    for bad in (
        "Delete %s?",
        "%(count)d items",
        "Hello {name}",
        "See <b>this</b>",
        "Go to https://example.org",
        "usage: /usr/bin/foo",
        "heading_auth_cookie_manual_override",
        "12345",
        " ".join(["word"] * 17),
    ):
        assert clean(bad, 16) is None, bad


def test_dedup_keeps_each_normalised_pair_once() -> None:
    entries = []
    for path in catalogue_paths():
        entries += parse_mo(path.with_suffix(".mo").read_bytes(), str(path))
    pairs = clean_pairs(entries, 16)
    # the regional catalogues repeat msgids: each (es, en) once after cleaning
    assert len({(key(p.spanish), key(p.english)) for p in pairs}) == len(pairs)
    assert len(pairs) < len(entries)
