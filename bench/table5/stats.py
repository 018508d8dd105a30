"""Paired statistics of the Table 5 rows against codec none: bootstrap intervals and a non-inferiority test.

Why: one system's BLEU on a few thousand sentences moves by about a point between samples and
between seeds, so "within 1.0 BLEU of none" cannot be read off two means. Each row is compared
with none on the *same* sentences and the *same* seeds (a seed fixes the data order and the
initialisation, whatever the row), by a two-level paired bootstrap (Koehn 2004 over sentences,
and over seeds): a replicate draws sentences and seeds with replacement, scores both systems'
corpus BLEU on the drawn sentences for each drawn seed, and takes the mean difference.

"Within budget" is a non-inferiority test (the one-sided half of an equivalence test): the row
passes when the 5th percentile of that difference lies above ``-BUDGET_SHARE`` x none's mean BLEU,
i.e. it is 95% sure the row loses less than 5% of none's score. Being better is never a failure.

The per-sentence statistics come from sacrebleu's own metric objects (the same calls its
``paired-bs`` test makes), so the BLEU of a replicate is sacrebleu's BLEU, lower-cased.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import numpy as np
from sacrebleu.metrics import BLEU

BUDGET_SHARE = 0.05
"""The quality budget: a row may lose at most 5% of codec none's mean BLEU."""
SAMPLES = 1000
"""Bootstrap replicates per comparison."""
SEED = 12345
"""The resampling's own seed (sacrebleu's default), so a report re-derives the same intervals."""

_BLEU = BLEU(lowercase=True, force=True)  # as train.score: the outputs are space-joined tokens


def sentence_stats(hypotheses: list[str], references: list[str]) -> np.ndarray:
    """Per-sentence BLEU sufficient statistics (n-gram matches and totals, lengths), one row each."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    return np.asarray(_BLEU._extract_corpus_statistics(hypotheses, [references]), dtype=np.int64)


def _bleu(summed: np.ndarray) -> float:
    return float(_BLEU._compute_score_from_stats(summed.tolist()).score)


@dataclass(frozen=True)
class Comparison:
    """A row against none: mean BLEU difference, its 95% interval, and the non-inferiority verdict."""

    difference: float
    low: float
    high: float
    lower_bound: float
    """The 5th percentile: the one-sided 95% bound the non-inferiority test reads."""
    budget: float
    """How much BLEU the row may lose: ``BUDGET_SHARE`` x none's mean BLEU."""
    within_budget: bool

    def record(self) -> dict[str, float | bool]:
        return asdict(self)


def compare(
    none: list[np.ndarray], row: list[np.ndarray], samples: int = SAMPLES, seed: int = SEED
) -> Comparison:
    """Paired two-level bootstrap of ``row`` - ``none``: one statistics array per seed, same sentences."""
    if not none or len(none) != len(row):
        raise ValueError(f"paired seeds needed: none has {len(none)}, the row {len(row)}")
    sentences = none[0].shape[0]
    if any(s.shape != none[0].shape for s in (*none, *row)):
        raise ValueError("every run must score the same sentences")
    none_mean = statistics.mean(_bleu(s.sum(0)) for s in none)
    observed = statistics.mean(_bleu(r.sum(0)) - _bleu(n.sum(0)) for n, r in zip(none, row, strict=True))
    rng = np.random.default_rng(seed)
    differences = np.empty(samples)
    for replicate in range(samples):
        drawn = rng.integers(0, sentences, sentences)
        seeds = rng.integers(0, len(none), len(none))
        differences[replicate] = np.mean(
            [_bleu(row[s][drawn].sum(0)) - _bleu(none[s][drawn].sum(0)) for s in seeds]
        )
    low, high = np.percentile(differences, [2.5, 97.5])
    lower_bound = float(np.percentile(differences, 5))
    budget = BUDGET_SHARE * none_mean
    return Comparison(observed, float(low), float(high), lower_bound, budget, lower_bound >= -budget)
