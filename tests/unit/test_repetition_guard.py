"""Greedy decoding's repetition guard: no n-gram twice in one output, and a looping decoder is cut."""

from __future__ import annotations

import pytest
import torch

from nebula_common.zoo.adapters import (
    NO_REPEAT_NGRAM,
    AdapterTransformerDecoder,
    LanguageModel,
    repeated_ngram_mask,
)
from nebula_common.zoo.text_data import BOS, EOS, MASK, PAD

VOCAB = 40


def ngrams(row: list[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(row[i : i + n]) for i in range(len(row) - n + 1)]


def test_the_mask_bans_exactly_the_tokens_that_would_repeat_an_ngram() -> None:
    ids = torch.tensor([[7, 8, 9, 7, 8], [5, 6, 5, 6, 5]])
    banned = lambda n: [set(torch.nonzero(row).flatten().tolist()) for row in repeated_ngram_mask(ids, n, 12)]  # noqa: E731
    assert banned(3) == [{9}, {6}]  # "7 8" was followed by 9; "6 5" by 6
    assert banned(2) == [{9}, {6}]  # "8" was followed by 9; "5" by 6
    assert banned(1) == [{7, 8, 9}, {5, 6}]  # no token twice
    assert banned(6) == [set(), set()]  # nothing that long yet
    assert not repeated_ngram_mask(ids[:, :1], 2, 12).any()


def looping_decoder() -> AdapterTransformerDecoder:
    """A real decoder whose output layer prefers the same two tokens at every position, EOS never."""
    torch.manual_seed(0)
    plm = LanguageModel(VOCAB, 16, 32, 4, 1, causal=True)
    decoder = AdapterTransformerDecoder(plm, 4, 16)
    with torch.no_grad():
        plm.head.weight.mul_(0.01)
        plm.head.bias.copy_(-torch.arange(VOCAB, dtype=torch.float) / VOCAB)
        plm.head.bias[[PAD, BOS, EOS, MASK]] = -10.0
        plm.head.bias[[20, 21]] = 5.0
    return decoder


def test_without_the_guard_the_decoder_loops_and_with_it_no_ngram_repeats() -> None:
    decoder = looping_decoder()
    memory = torch.randn(3, 5, 32)
    loops = decoder.greedy(memory, 16, no_repeat_ngram=0)[:, 1:].tolist()
    assert all(len(set(ngrams(row, 3))) < len(ngrams(row, 3)) for row in loops), loops
    for n in (1, 2, NO_REPEAT_NGRAM):
        out = decoder.greedy(memory, 16, no_repeat_ngram=n)
        assert out.shape == (3, 16) and bool((out[:, 0] == BOS).all())
        for row in out[:, 1:].tolist():
            assert len(set(ngrams(row, n))) == len(ngrams(row, n)), (n, row)
            assert not {PAD, BOS, MASK} & set(row)
    # The guard is the default (the product's decoding and Table 5's): no 3-gram twice.
    default = decoder.greedy(memory, 16)
    torch.testing.assert_close(default, decoder.greedy(memory, 16, no_repeat_ngram=NO_REPEAT_NGRAM))


def test_a_negative_guard_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="no_repeat_ngram must be >= 0, got -1"):
        looping_decoder().greedy(torch.zeros(1, 2, 32), 4, no_repeat_ngram=-1)
