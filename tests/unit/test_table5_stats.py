"""Table 5's paired statistics and lookup baseline on real sentences (Django's English catalogue strings).

The bootstrap must: give a zero-width interval and a pass for a row identical to none; put a row
that drops words from every sentence outside a 5% budget; keep a row that differs only in a few
sentences inside it; refuse unpaired runs; and re-derive the same interval from the same seed.
The corpus loader reads the split it is asked for and names a bad split or line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from nebula_common.zoo.catalogues import Pair, clean_pairs, parse_mo
from nebula_common.zoo.text_data import catalogue_paths

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "table5"))
import corpus
import lookup
import stats

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pairs() -> list[Pair]:
    entries = []
    for path in catalogue_paths():
        entries += parse_mo(path.with_suffix(".mo").read_bytes(), str(path))
    found = [p for p in clean_pairs(entries, 16) if len(p.english.split()) >= 3]
    assert len(found) >= 300
    return found[:300]


def _drop_last_word(text: str) -> str:
    return " ".join(text.split()[:-1])


def test_identical_rows_pass_and_a_damaged_row_fails_the_budget(pairs: list[Pair]) -> None:
    references = [p.english for p in pairs]
    # none: perfect on most sentences, the last word lost on every third (per seed, a different third)
    none_runs = [
        [_drop_last_word(r) if i % 3 == seed else r for i, r in enumerate(references)] for seed in range(3)
    ]
    none = [stats.sentence_stats(h, references) for h in none_runs]
    same = stats.compare(none, none, samples=200)
    assert same.difference == 0 and same.low == 0 and same.high == 0 and same.within_budget
    damaged = [stats.sentence_stats([_drop_last_word(r) for r in references], references)] * 3
    worse = stats.compare(none, damaged, samples=200)
    assert worse.high < 0 and not worse.within_budget
    assert worse.low <= worse.difference <= worse.high and worse.lower_bound < -worse.budget
    # five sentences of 300 worse: a small loss, inside 5% of none's score
    slightly = [
        stats.sentence_stats(
            [
                _drop_last_word(r) if i < 5 else h
                for i, (h, r) in enumerate(zip(seed_run, references, strict=True))
            ],
            references,
        )
        for seed_run in none_runs
    ]
    close = stats.compare(none, slightly, samples=200)
    assert close.difference < 0 and close.within_budget, close
    assert stats.compare(none, slightly, samples=200) == close  # the resampling's own seed: same interval


def test_unpaired_runs_are_refused(pairs: list[Pair]) -> None:
    references = [p.english for p in pairs]
    one = stats.sentence_stats(references, references)
    with pytest.raises(ValueError, match="paired seeds"):
        stats.compare([one, one], [one])
    with pytest.raises(ValueError, match="same sentences"):
        stats.compare([one], [stats.sentence_stats(references[:10], references[:10])])
    with pytest.raises(ValueError, match="hypotheses for"):
        stats.sentence_stats(references[:3], references)


def test_the_lookup_copies_the_nearest_training_translation(pairs: list[Pair]) -> None:
    training = pairs[:200]
    exact = lookup.lookup(training, [p.spanish for p in training[:20]])
    assert (
        exact == [p.english for p in training[:20]]
        or all(  # a duplicate Spanish side may map either way
            out in {q.english for q in training if q.spanish == p.spanish}
            for out, p in zip(exact, training[:20], strict=True)
        )
    )
    typo = training[7].spanish[:-1] + "x"
    assert lookup.lookup(training, [typo]) == [training[7].english]
    with pytest.raises(ValueError, match="training pairs"):
        lookup.lookup([], ["hola"])


def test_the_corpus_loader_reads_the_named_split_and_refuses_any_other(tmp_path: Path) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name, line in (("train", "Abrir\tOpen\n"), ("dev", "Cerrar\tClose\n"), ("test", "Salir\tQuit\n")):
        (folder / f"{name}.tsv").write_text(line)
    digests = {f"{name}.tsv": "x" for name in ("train", "dev", "test")}
    # built from the pinned sources (a manifest of other versions would be rebuilt: test_table5_corpus_pins)
    sources = json.loads((ROOT / "bench" / "results" / "table5" / "corpus-manifest.json").read_text())[
        "sources"
    ]
    (folder / "manifest.json").write_text(json.dumps({"sha256": digests, "sources": sources}))
    _, training, evaluated = corpus.load(tmp_path, "test")
    assert training == [Pair("Abrir", "Open")] and evaluated == [Pair("Salir", "Quit")]
    assert corpus.load(tmp_path, "dev")[2] == [Pair("Cerrar", "Close")]
    with pytest.raises(corpus.CorpusError, match="'dev' or 'test', not 'held_out'"):
        corpus.load(tmp_path, "held_out")
    (folder / "dev.tsv").write_text("no tab here\n")
    with pytest.raises(corpus.CorpusError, match=r"dev\.tsv:1: not 'spanish<TAB>english'"):
        corpus.load(tmp_path, "dev")
