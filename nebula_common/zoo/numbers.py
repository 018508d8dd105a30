"""A small real translation task: digits ("4073") to English words ("four thousand seventy three").

The data of the ``numbers`` built-in job (the demo's) and of ``electra``, which
reuses its word side as a corpus. Example id n is the number n on both sides.

Why this task: it has real structure (place values, irregular teens, a
variable-length output) that a seq2seq model must learn, it needs no download,
and a 2-layer transformer learns it within a minute on two CPU cores, so the
demo shows a loss that visibly falls. The corpus is split by *field*, as in the
paper's ABNet-cloud: the source cluster only ever materialises the digit
strings, the target cluster only the word strings; they align by example id.
"""

from __future__ import annotations

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
TARGET_INDEX = {word: i for i, word in enumerate(TARGET_VOCAB)}


def number_to_words(n: int) -> list[str]:
    """English words of ``n`` (0..MAX_NUMBER), as the target side of the task holds them."""
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
