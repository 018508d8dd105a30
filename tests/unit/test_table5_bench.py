"""The Table 5 benchmark's parts on real pieces: codec-in-the-loop fine-tuning and the emulated-link clock.

Small and offline (Django's installed catalogues stand in for the fetched corpus); the benchmark's
numbers themselves live in docs/bench/table5.md. Timing checks are one-sided: load can only slow a
transfer down, never make it beat the link's cap.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from nebula_common.wan import LinkShape
from nebula_common.zoo.catalogues import clean_pairs, parse_mo, split
from nebula_common.zoo.text_data import catalogue_paths

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "table5"))
import run
import train

pytestmark = pytest.mark.timeout(120)
TINY = train.ModelConfig(d_model=32, n_layers=1, vocab=600, batch=8, pretrain_steps=3)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """As the benchmark runs: one torch thread (tiny tensors; more threads only contend on a busy host)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> train.Prepared:
    entries = [e for p in catalogue_paths() for e in parse_mo(p.with_suffix(".mo").read_bytes(), str(p))]
    train_pairs, held = split(clean_pairs(entries, 16), 0.1, seed=13)
    return train.prepare(train_pairs, held, TINY, tmp_path_factory.mktemp("models"), "django")


def test_codecs_and_bottleneck_shrink_the_frames_by_their_ratios(prepared: train.Prepared) -> None:
    raw = TINY.batch * TINY.length * TINY.d_model * 4
    none = train.fine_tune(prepared, train.Row("none"), 0, steps=2, eval_pairs=16)
    cut = train.fine_tune(prepared, train.Row("cut", "int8", "int8", cut_k=4), 0, steps=2, eval_pairs=16)
    header = none.forward_bytes[-1] - raw
    assert 0 < header < 200  # a frame is the serialized header plus the payload
    elements = TINY.batch * TINY.length * 4  # k = 4 of d = 32: what crosses, each way
    for frames in (cut.forward_bytes, cut.backward_bytes):  # one byte each + int8's 4-byte scale + header
        assert elements + 4 < frames[-1] <= elements + 4 + 200
    assert 0 < cut.energy < 1  # the bottleneck started from a real calibration subspace
    assert len(none.losses) == 2 and 0 <= none.bleu <= 100 and 0 <= cut.chrf <= 100


def test_the_link_clock_never_beats_the_emulated_cap() -> None:
    shape = LinkShape(bandwidth_mbit=8.0, delay_ms=5.0)
    forward, backward = os.urandom(60_000), os.urandom(20_000)
    seconds = run.link_seconds(shape, forward, backward, repeats=2)
    floor = (
        2 * shape.delay_ms / 1000
        + (shape.wire_bytes(80_008) - 2 * shape.burst_bytes) * 8 / shape.bits_per_second
    )
    assert seconds >= floor, f"{seconds:.3f} s for 80 kB at 8 Mbit/s beats the cap (floor {floor:.3f} s)"
    assert seconds < 30
