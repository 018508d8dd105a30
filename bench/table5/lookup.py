"""The lookup baseline: translate by copying the English of the most similar Spanish training source.

Why: on software catalogues a translation memory is the first thing to beat. A model that
scores under this lookup has learned the training set's strings, not how to translate, so the
table reports the lookup beside codec none on the same test pairs. Similarity is
``rapidfuzz.fuzz.ratio`` (normalised Indel distance) on the normalised Spanish sides
(``catalogues.key``); ties go to the first training pair.

    PYTHONPATH=$PWD .venv/bin/python bench/table5/lookup.py --split dev
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from rapidfuzz import fuzz, process

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import corpus
import train

from nebula_common.zoo.catalogues import Pair, key

_CHUNK = 256


def lookup(training: list[Pair], sources: list[str]) -> list[str]:
    """For each Spanish source, the English side of its nearest training pair."""
    if not training:
        raise ValueError("the lookup needs training pairs")
    choices = [key(pair.spanish) for pair in training]
    outputs: list[str] = []
    for begin in range(0, len(sources), _CHUNK):
        queries = [key(source) for source in sources[begin : begin + _CHUNK]]
        scores = process.cdist(queries, choices, scorer=fuzz.ratio, dtype=np.uint8, workers=-1)
        outputs += [training[int(index)].english for index in scores.argmax(axis=1)]
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path(".cache") / "table5")
    parser.add_argument("--split", choices=("dev", "test"), default="dev")
    args = parser.parse_args()
    _, training, evaluated = corpus.load(args.cache, args.split)
    outputs = lookup(training, [pair.spanish for pair in evaluated])
    bleu, chrf = train.score(outputs, [pair.english for pair in evaluated])
    print(
        json.dumps(
            {"split": args.split, "pairs": len(evaluated), "bleu": round(bleu, 2), "chrf": round(chrf, 1)}
        )
    )


if __name__ == "__main__":
    main()
