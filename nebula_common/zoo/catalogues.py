"""Spanish-English pairs from compiled gettext catalogues (``.mo``), cleaned and deduplicated.

Why ``.mo``: every package that ships translations ships the compiled catalogue
(Debian packages often ship nothing else), and a ``.mo`` holds only what the
program would show: no fuzzy entries, no obsolete ones. Each entry is a human
translation (msgid = English, msgstr = Spanish); the paper's direction is
Es->En, so the *source* is Spanish.

Cleaning keeps what reads like a sentence or a label: keyboard mnemonics
(``_File``, ``&Open``) are removed, whitespace is collapsed, and a pair is dropped
if either side holds a placeholder (``%s``, ``{0}``, ``${x}``), markup, a path or
URL, a snake_case identifier (some catalogues use message ids as msgids), no
letter, too many words, or if the Spanish equals the English (untranslated).

The split into train, dev and test is ``nebula_common.zoo.splits``.
"""

from __future__ import annotations

import re
import struct
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass

MO_MAGIC_LE = 0x950412DE
MAX_MO_BYTES = 64 * 1024 * 1024
"""Largest catalogue accepted (the largest Debian/PyPI Spanish catalogue we use is ~1 MB)."""

_MNEMONIC = re.compile(r"(?<![\w&])[_&](?=\w)")
_REJECT = re.compile(
    r"%[-+ #0-9.*]*[a-zA-Z%(]"  # printf placeholders, %(name)s
    r"|\$\{|\{[\w.:!]*\}|\{\{|\}\}"  # ${x}, {0}, {name}, {{ }}
    r"|<[^>]*>|&\w+;"  # markup, entities
    r"|https?:|www\.|\\|/\w|\w/|`|\|"  # URLs, paths, escapes, code, tables
    r"|[\x00-\x1f]"  # control characters (tabs, newlines inside one entry)
    r"|[^\W_]_+[^\W_]|^\w+_$"  # message ids used as msgids (Plone's heading_foo_bar), snake_case names
)
_LETTER = re.compile(r"[^\W\d_]")


class CatalogueError(ValueError):
    """A catalogue could not be parsed; the message names the file and what was wrong."""


@dataclass(frozen=True)
class Pair:
    spanish: str
    english: str


def parse_mo(data: bytes, origin: str = "<bytes>") -> list[tuple[str, str]]:
    """(msgid, msgstr) of every translated singular entry of a compiled catalogue.

    Context (``msgctxt``) is dropped from the msgid; plural entries and the
    header (empty msgid) are skipped. Strings are decoded with the charset the
    header names (UTF-8 when it names none).
    """
    if len(data) > MAX_MO_BYTES:
        raise CatalogueError(f"{origin}: {len(data)} bytes, larger than the {MAX_MO_BYTES} accepted")
    if len(data) < 28:
        raise CatalogueError(f"{origin}: {len(data)} bytes is too short for a .mo header")
    for order in ("<", ">"):
        magic, revision, count, ids_at, strs_at = struct.unpack_from(f"{order}5I", data)
        if magic == MO_MAGIC_LE:
            break
    else:
        raise CatalogueError(f"{origin}: not a .mo file (bad magic {data[:4].hex()})")
    if revision >> 16 not in (0, 1):
        raise CatalogueError(f"{origin}: unsupported .mo major revision {revision >> 16}")
    if ids_at + 8 * count > len(data) or strs_at + 8 * count > len(data):
        raise CatalogueError(f"{origin}: {count} entries do not fit in {len(data)} bytes")

    def string(table: int, index: int) -> bytes:
        length, offset = struct.unpack_from(f"{order}2I", data, table + 8 * index)
        if offset + length > len(data):
            raise CatalogueError(f"{origin}: entry {index} points past the end of the file")
        return data[offset : offset + length]

    raw = [(string(ids_at, i), string(strs_at, i)) for i in range(count)]
    charset = "utf-8"
    for msgid, msgstr in raw:
        if msgid == b"":
            found = re.search(rb"charset=([\w-]+)", msgstr)
            if found and found.group(1).lower() not in (b"charset", b""):
                charset = found.group(1).decode("ascii")
    entries = []
    for msgid, msgstr in raw:
        if not msgid or b"\x00" in msgid or not msgstr:
            continue  # header, plural, untranslated
        try:
            english = msgid.decode(charset)
            spanish = msgstr.decode(charset)
        except (LookupError, UnicodeDecodeError) as exc:
            raise CatalogueError(f"{origin}: entry not decodable as {charset}: {exc}") from exc
        entries.append((english.rpartition("\x04")[2], spanish))
    return entries


def clean(text: str, max_words: int) -> str | None:
    """A display string as a plain sentence, or None if it is not one (see the module docstring)."""
    text = unicodedata.normalize("NFC", text)
    if _REJECT.search(text):
        return None
    text = " ".join(_MNEMONIC.sub("", text).split())
    if not _LETTER.search(text) or len(text.split()) > max_words or len(text) > 12 * max_words:
        return None
    return text


def key(text: str) -> str:
    """The normalised form two sides are compared by: case, accents-as-typed and punctuation kept apart."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.casefold()).split())


def clean_pairs(entries: Iterable[tuple[str, str]], max_words: int) -> list[Pair]:
    """Cleaned pairs, each (normalised Spanish, normalised English) once, in a stable order."""
    seen: dict[tuple[str, str], Pair] = {}
    for english, spanish in entries:
        en, es = clean(english, max_words), clean(spanish, max_words)
        if en is None or es is None or key(en) == key(es) or not key(es) or not key(en):
            continue
        seen.setdefault((key(es), key(en)), Pair(spanish=es, english=en))
    return sorted(seen.values(), key=lambda p: (key(p.spanish), key(p.english), p.spanish, p.english))
