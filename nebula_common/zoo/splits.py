"""Train / dev / test splits of a parallel corpus with no near copy of a dev or test pair in training.

Why this much care: software catalogues repeat themselves. "30 days" and "3 days",
"Open File" and "Open Files…" are different strings but one translation memory lookup
apart, so a split that only keeps exact duplicates apart measures recall, not
translation (a nearest-neighbour lookup into the training set beat the model on such a
split). Three rules, applied in order:

1. **Groups.** Pairs that share a normalised side (``catalogues.key``) or a *loose* side
   (``loose_key``: case, accents, digits and punctuation dropped) are one group
   (union-find), and a whole group goes to one split, chosen by a SHA-256 of the group's
   smallest key and the seed.
2. **Near copies.** A dev or test pair whose Spanish or English loose side is within
   ``NEAR_RATIO`` (``rapidfuzz.fuzz.ratio``, a normalised Indel similarity, 0-100) of the
   same side of any training pair moves to training; so does a test pair near a dev pair.
   Moving a pair can make another one near, so this repeats until nothing moves.
3. Tuning reads dev only; test is read once per reported run.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass

import numpy as np
from rapidfuzz import fuzz, process

from nebula_common.zoo.catalogues import Pair, key

NEAR_RATIO = 90.0
"""Two loose sides at least this similar (``fuzz.ratio``) are near copies: "abrir archivo" and
"abrir archivos" (96) are, "guardar como" and "guardar todo" (75) are not."""
_CHUNK = 512
"""Query rows per ``cdist`` call: a 512 x 100k uint8 score matrix is 50 MB."""


@dataclass(frozen=True)
class Split:
    """The three splits and how many pairs rule 2 moved into training."""

    train: list[Pair]
    dev: list[Pair]
    test: list[Pair]
    moved: int


def loose_key(text: str) -> str:
    """What two near-identical UI strings share: lower case, no accents, digits or punctuation."""
    decomposed = unicodedata.normalize("NFD", text.casefold())
    letters = "".join(c for c in decomposed if not unicodedata.combining(c))
    return " ".join(re.sub(r"[\W\d_]+", " ", letters).split())


def _groups(pairs: list[Pair]) -> list[str]:
    """Each pair's group root: pairs linked by an equal normalised or loose side share it."""
    parent: dict[str, str] = {}

    def find(node: str) -> str:
        root = node
        while parent[root] != root:
            root = parent[root]
        while parent[node] != root:
            parent[node], node = root, parent[node]
        return root

    def nodes(pair: Pair) -> list[str]:
        return [
            "es:" + key(pair.spanish),
            "en:" + key(pair.english),
            "les:" + loose_key(pair.spanish),
            "len:" + loose_key(pair.english),
        ]

    for pair in pairs:
        linked = nodes(pair)
        for node in linked:
            parent.setdefault(node, node)
        for node in linked[1:]:
            ra, rb = find(linked[0]), find(node)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)  # the smallest key is each group's root
    return [find(nodes(pair)[0]) for pair in pairs]


def near_any(queries: list[str], choices: list[str], threshold: float = NEAR_RATIO) -> list[bool]:
    """For each query, whether some choice is at least ``threshold`` similar (``fuzz.ratio``)."""
    if not queries or not choices:
        return [False] * len(queries)
    found: list[bool] = []
    for begin in range(0, len(queries), _CHUNK):
        scores = process.cdist(
            queries[begin : begin + _CHUNK],
            choices,
            scorer=fuzz.ratio,
            score_cutoff=threshold,
            dtype=np.uint8,
            workers=-1,
        )
        found += (scores >= threshold).any(axis=1).tolist()
    return found


def _near(pairs: list[Pair], against: list[Pair]) -> list[bool]:
    """Whether each pair has a near copy in ``against`` on its Spanish or its English side."""
    es = near_any([loose_key(p.spanish) for p in pairs], [loose_key(p.spanish) for p in against])
    en = near_any([loose_key(p.english) for p in pairs], [loose_key(p.english) for p in against])
    return [a or b for a, b in zip(es, en, strict=True)]


def split(pairs: list[Pair], dev_fraction: float, test_fraction: float, seed: int) -> Split:
    """Train, dev and test (see the module docstring); deterministic for a seed."""
    if not (0 < dev_fraction < 1 and 0 < test_fraction < 1 and dev_fraction + test_fraction < 1):
        raise ValueError(
            f"dev_fraction and test_fraction must be in (0, 1) with a sum under 1, "
            f"got {dev_fraction} and {test_fraction}"
        )
    dev_below = int(dev_fraction * 2**32)
    test_below = int((dev_fraction + test_fraction) * 2**32)
    train, dev, test = [], [], []
    for pair, root in zip(pairs, _groups(pairs), strict=True):
        value = int.from_bytes(hashlib.sha256(f"{seed}:{root}".encode()).digest()[:4], "big")
        (dev if value < dev_below else test if value < test_below else train).append(pair)
    near_dev = _near(test, dev)  # dev only shrinks (into training): one comparison covers every round
    fresh = [p for p, n in zip(test, near_dev, strict=True) if n]
    test[:] = [p for p, n in zip(test, near_dev, strict=True) if not n]
    moved = len(fresh)
    train += fresh
    fresh = list(train)  # training pairs dev and test were not yet compared with
    while fresh:
        dev_near, test_near = _near(dev, fresh), _near(test, fresh)
        fresh = []
        for held, near in ((dev, dev_near), (test, test_near)):
            fresh += [p for p, n in zip(held, near, strict=True) if n]
            held[:] = [p for p, n in zip(held, near, strict=True) if not n]
        train += fresh
        moved += len(fresh)
    order = {id(pair): index for index, pair in enumerate(pairs)}
    train.sort(key=lambda p: order[id(p)])  # the input's order, whatever moved
    return Split(train, dev, test, moved)
