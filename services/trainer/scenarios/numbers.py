"""A small real translation task: digits ("4073") to English words ("four thousand seventy three").

Why this task: it has real structure (place values, irregular teens, a
variable-length output) that a seq2seq model must learn, it needs no download,
and a 2-layer transformer learns it within a minute on two CPU cores, so the
demo shows a loss that visibly falls. The corpus is split by *field*, as in the
paper's ABNet-cloud: the source cluster only ever materialises the digit
strings, the target cluster only the word strings; they align by example id.
"""

from __future__ import annotations

import torch

MAX_NUMBER = 9999
PAD, BOS, EOS = 0, 1, 2
SOURCE_VOCAB = ["<pad>", "<bos>", "<eos>", *"0123456789"]
SOURCE_LEN = 4

_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
_TEENS = [
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
TARGET_VOCAB = ["<pad>", "<bos>", "<eos>", *_ONES, *_TEENS, *_TENS[2:], "hundred", "thousand"]
TARGET_LEN = 8  # BOS + up to 6 words + EOS ("seven thousand seven hundred seventy seven")
_TARGET_INDEX = {word: i for i, word in enumerate(TARGET_VOCAB)}


def number_to_words(n: int) -> list[str]:
    if not 0 <= n <= MAX_NUMBER:
        raise ValueError(f"number {n} outside 0..{MAX_NUMBER}")
    if n == 0:
        return ["zero"]
    words: list[str] = []
    thousands, rest = divmod(n, 1000)
    hundreds, rest = divmod(rest, 100)
    if thousands:
        words += [_ONES[thousands], "thousand"]
    if hundreds:
        words += [_ONES[hundreds], "hundred"]
    if 10 <= rest < 20:
        words.append(_TEENS[rest - 10])
    else:
        tens, ones = divmod(rest, 10)
        if tens:
            words.append(_TENS[tens])
        if ones:
            words.append(_ONES[ones])
    return words


def example_ids(
    seed: int, step: int, micro_batch: int, micro_batches: int, micro_batch_size: int
) -> torch.Tensor:
    """Example ids of one micro-batch; both clusters derive the same ids from the shared seed."""
    epoch_size = MAX_NUMBER + 1
    offset = ((step * micro_batches + micro_batch) * micro_batch_size) % epoch_size
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(epoch_size, generator=generator)
    return order[(torch.arange(micro_batch_size) + offset) % epoch_size]


class SourceShard:
    """What the source cluster holds: digit strings, indexed by example id."""

    def batch(self, ids: torch.Tensor) -> torch.Tensor:
        rows = []
        for n in ids.tolist():
            digits = [SOURCE_VOCAB.index(ch) for ch in str(n)]
            rows.append([PAD] * (SOURCE_LEN - len(digits)) + digits)
        return torch.tensor(rows, dtype=torch.long)


class TargetShard:
    """What the target cluster holds: word sequences, indexed by example id."""

    def batch(self, ids: torch.Tensor) -> torch.Tensor:
        rows = []
        for n in ids.tolist():
            tokens = [BOS, *(_TARGET_INDEX[w] for w in number_to_words(n)), EOS]
            rows.append(tokens + [PAD] * (TARGET_LEN - len(tokens)))
        return torch.tensor(rows, dtype=torch.long)
