"""The real Spanish-English corpus (Django's catalogues) and the per-side tokenizers."""

from __future__ import annotations

from pathlib import Path

import pytest

from nebula_common.zoo import text_data
from nebula_common.zoo.text_data import BOS, EOS, PAD, Pair, TextDataError


def test_pairs_are_real_translations_and_the_split_is_disjoint_and_deterministic() -> None:
    train, held = text_data.split_pairs(10)
    assert len(train) > 500 and len(held) > 40
    assert Pair(spanish="Administración", english="Administration") in train + held
    assert all(len(p.spanish.split()) <= text_data.MAX_WORDS for p in train + held)
    assert not {p.english.lower() for p in train} & {p.english.lower() for p in held}
    assert not set(train) & set(held)
    assert len({p.spanish.lower() for p in train + held}) == len(train) + len(held)  # deduplicated
    again_train, again_held = text_data.split_pairs(10)
    assert (again_train, again_held) == (train, held)


def test_split_rejects_a_bad_percentage() -> None:
    with pytest.raises(ValueError, match="held_out_percent"):
        text_data.split_pairs(0)


def test_po_parser_skips_fuzzy_plural_and_header_and_joins_continuations(tmp_path: Path) -> None:
    po = tmp_path / "x.po"
    po.write_text(
        'msgid ""\nmsgstr "Content-Type: text/plain\\n"\n\n'
        'msgid "Save"\nmsgstr "Guardar"\n\n'
        '#, fuzzy\nmsgid "Old"\nmsgstr "Viejo"\n\n'
        'msgid "one item"\nmsgid_plural "items"\nmsgstr[0] "un"\nmsgstr[1] "varios"\n\n'
        'msgid ""\n"Log "\n"out"\nmsgstr "Terminar sesión"\n',
        encoding="utf-8",
    )
    assert text_data.parse_po(po) == [("Save", "Guardar"), ("Log out", "Terminar sesión")]
    po.write_text('msgid "x"\nmsgfoo "y"\n', encoding="utf-8")
    with pytest.raises(TextDataError, match="unknown PO keyword"):
        text_data.parse_po(po)


def test_tokenizer_round_trip_and_layout() -> None:
    train, held = text_data.split_pairs(10)
    tokenizer = text_data.side_tokenizer("en", 1000, 10)
    assert tokenizer.get_vocab_size() <= 1000
    sentences = [p.english for p in held[:20]]
    rows = text_data.encode(tokenizer, sentences, 24, bos=True)
    for sentence, row in zip(sentences, rows, strict=True):
        assert len(row) == 24 and row[0] == BOS and EOS in row
        assert all(t == PAD for t in row[row.index(EOS) + 1 :])
        tokens = tokenizer.encode(sentence).tokens
        if "[UNK]" not in tokens and len(tokens) <= 22:  # not cut to the length
            assert text_data.decode(tokenizer, row[1:]).split() == tokens
    again = text_data.train_tokenizer(text_data.side(train, "en"), 1000)
    assert again.get_vocab() == tokenizer.get_vocab()  # deterministic


def test_tokenizer_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="empty corpus"):
        text_data.train_tokenizer([], 1000)
    with pytest.raises(ValueError, match="language"):
        text_data.side([], "fr")
