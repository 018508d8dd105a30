"""Real Spanish-English sentence pairs, offline: Django's gettext catalogues (BSD-3), and their tokenizers.

Why Django: it is installed with the project's ``text`` extra, so every fresh
machine holds the same ~13 Spanish catalogues (core + contrib apps) without a
download step; each entry is a human translation (msgid = English, msgstr =
Spanish). The paper's direction is Es->En, so the *source* is Spanish (cluster
S) and the *target* English (cluster T).

The split is a pure function of the pair's text (a SHA-256 of the normalised
English side), not of file order, so a new Django release moves only the pairs
it adds or removes, and an English sentence with every Spanish phrasing of it
(the regional catalogues repeat msgids) sits in exactly one split: no held-out
reference is ever seen in training.

Tokenizers are built per side on the *training* split only, inside the
cluster that holds that side (S never sees English, T never Spanish), and are
deterministic: the same corpus gives the same vocabulary on every machine.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from nebula_common import pysource

PAD, BOS, EOS, UNK, MASK = 0, 1, 2, 3, 4
SPECIALS = ("[PAD]", "[BOS]", "[EOS]", "[UNK]", "[MASK]")
MAX_WORDS = 12  # "short, plain" pairs: both sides at most this many words
_PLACEHOLDER = re.compile(r"%\(|%[sdr]|\{|<|>|\\|https?:|&|_")


class TextDataError(RuntimeError):
    """The corpus could not be found or parsed; the message says what to install or fix."""


@dataclass(frozen=True)
class Pair:
    spanish: str
    english: str


def catalogue_paths() -> list[Path]:
    """Every Spanish ``.po`` catalogue Django ships, all regional variants (sorted: a stable order)."""
    try:
        import django
    except ImportError as exc:
        raise TextDataError(
            "the Spanish-English corpus comes from Django's catalogues: pip install 'nebula[text]'"
        ) from exc
    root = Path(django.__file__).resolve().parent
    paths = sorted(root.glob("**/locale/es*/LC_MESSAGES/*.po"))  # es, es_AR, es_CO, es_MX, es_VE
    if not paths:
        raise TextDataError(f"no Spanish catalogues under {root} (a Django build without locales?)")
    return paths


def _unquote(line: str, path: Path, number: int) -> str:
    try:
        value = pysource.literal(line)
    except (ValueError, SyntaxError) as exc:
        raise TextDataError(f"{path}:{number}: not a quoted PO string: {line[:60]!r}") from exc
    if not isinstance(value, str):
        raise TextDataError(f"{path}:{number}: not a quoted PO string: {line[:60]!r}")
    return value


def parse_po(path: Path) -> list[tuple[str, str]]:
    """(msgid, msgstr) of a PO file's singular, non-fuzzy, translated entries (plurals are skipped)."""
    entries: list[tuple[str, str]] = []
    fields: dict[str, str] = {}
    current: str | None = None
    fuzzy = False

    def flush() -> None:
        nonlocal fuzzy
        singular = "msgid_plural" not in fields and not fuzzy
        if singular and fields.get("msgid") and fields.get("msgstr"):
            entries.append((fields["msgid"], fields["msgstr"]))
        fields.clear()
        fuzzy = False

    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.strip()
        if not line:
            flush()
            current = None
        elif line.startswith("#,") and "fuzzy" in line:
            fuzzy = True
        elif line.startswith("#"):
            continue
        elif line.startswith('"'):
            if current is None:
                raise TextDataError(f"{path}:{number}: continuation line outside an entry")
            fields[current] += _unquote(line, path, number)
        else:
            keyword, _, rest = line.partition(" ")
            if keyword.startswith("msgstr["):
                fields["msgid_plural"] = fields.get("msgid_plural", "")
                current = "ignored"
                fields[current] = ""
                continue
            if keyword not in ("msgid", "msgstr", "msgctxt", "msgid_plural"):
                raise TextDataError(f"{path}:{number}: unknown PO keyword {keyword!r}")
            current = keyword
            fields[current] = _unquote(rest, path, number)
    flush()
    return entries


def _plain(text: str) -> str | None:
    text = " ".join(text.split())
    if not re.search(r"\w", text) or _PLACEHOLDER.search(text) or len(text.split()) > MAX_WORDS:
        return None
    return text


@lru_cache(maxsize=1)
def all_pairs() -> tuple[Pair, ...]:
    """Short plain pairs from every catalogue, deduplicated: each Spanish line once (first one wins).

    Regional catalogues translate the same English line differently; each
    distinct Spanish phrasing is its own pair (more real data), and the split
    below keeps all of them on the same side.
    """
    seen: dict[str, Pair] = {}
    for path in catalogue_paths():
        for english, spanish in parse_po(path):
            en, es = _plain(english), _plain(spanish)
            if en is None or es is None:
                continue
            key = es.lower()
            if key not in seen:
                seen[key] = Pair(spanish=es, english=en)
    pairs = tuple(sorted(seen.values(), key=lambda p: (p.spanish.lower(), p.english)))
    if len(pairs) < 100:
        raise TextDataError(f"only {len(pairs)} usable pairs in Django's Spanish catalogues")
    return pairs


def is_held_out(pair: Pair, held_out_percent: int) -> bool:
    """A pair's split from its English text alone: stable across machines and Django versions."""
    digest = hashlib.sha256(pair.english.lower().encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 100 < held_out_percent


def split_pairs(held_out_percent: int = 10) -> tuple[list[Pair], list[Pair]]:
    """(train, held_out): disjoint, deterministic."""
    if not 1 <= held_out_percent <= 50:
        raise ValueError(f"held_out_percent must be in 1..50, got {held_out_percent}")
    train, held = [], []
    for pair in all_pairs():
        (held if is_held_out(pair, held_out_percent) else train).append(pair)
    return train, held


def side(pairs: list[Pair], language: str) -> list[str]:
    """One language of the pairs: all a cluster is given (S: ``es``, T: ``en``)."""
    if language == "es":
        return [p.spanish for p in pairs]
    if language == "en":
        return [p.english for p in pairs]
    raise ValueError(f"language must be 'es' or 'en', got {language!r}")


def train_tokenizer(sentences: list[str], vocab_size: int) -> Tokenizer:
    """A word-level tokenizer (lower-cased, BERT pre-tokenisation) built from ``sentences`` only.

    Why word-level and our own counting: the library's WordPiece/BPE trainers
    break frequency ties through hash maps seeded per process, so two trainings
    on the same corpus give different ids, and pre-training and fine-tuning run
    in different processes. Here the vocabulary is the ``vocab_size`` most
    frequent pre-tokens, ties broken alphabetically: identical on every machine.
    """
    if not sentences:
        raise ValueError("cannot train a tokenizer on an empty corpus")
    if vocab_size < len(SPECIALS) + 32:
        raise ValueError(f"vocab_size {vocab_size} is too small (need >= {len(SPECIALS) + 32})")
    normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    counts: Counter[str] = Counter()
    for sentence in sentences:
        counts.update(word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(sentence)))
    ranked = sorted(counts, key=lambda word: (-counts[word], word))[: vocab_size - len(SPECIALS)]
    vocab = {token: index for index, token in enumerate((*SPECIALS, *ranked))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    return tokenizer


@lru_cache(maxsize=4)
def side_tokenizer(language: str, vocab_size: int, held_out_percent: int) -> Tokenizer:
    """The tokenizer a cluster trains on its own side of the training split."""
    train, _ = split_pairs(held_out_percent)
    return train_tokenizer(side(train, language), vocab_size)


def encode(tokenizer: Tokenizer, sentences: list[str], length: int, *, bos: bool) -> list[list[int]]:
    """Token ids padded (or cut) to ``length``, ending in EOS; with ``bos`` also starting with BOS."""
    rows = []
    for encoding in tokenizer.encode_batch(sentences):
        body = encoding.ids[: length - 1 - int(bos)]
        row = ([BOS] if bos else []) + body + [EOS]
        rows.append(row + [PAD] * (length - len(row)))
    return rows


def decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    """Ids -> text, stopping at the first EOS and dropping specials."""
    kept = []
    for token in ids:
        if token == EOS:
            break
        if token >= len(SPECIALS):
            kept.append(token)
    return tokenizer.decode(kept)
