"""The ABNet stages and the task: what the runner relies on to be correct across the cut."""

from __future__ import annotations

import pytest
import torch

from services.trainer.scenarios.abnet import build_stage
from services.trainer.scenarios.numbers import (
    EOS,
    MAX_NUMBER,
    SOURCE_LEN,
    TARGET_LEN,
    SourceShard,
    TargetShard,
    example_ids,
    number_to_words,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("number", "words"),
    [
        (0, "zero"),
        (7, "seven"),
        (13, "thirteen"),
        (40, "forty"),
        (101, "one hundred one"),
        (1900, "one thousand nine hundred"),
        (4073, "four thousand seventy three"),
        (9999, "nine thousand nine hundred ninety nine"),
    ],
)
def test_number_to_words(number: int, words: str) -> None:
    assert " ".join(number_to_words(number)) == words


def test_number_out_of_range_is_an_error() -> None:
    with pytest.raises(ValueError, match="outside"):
        number_to_words(MAX_NUMBER + 1)


def test_both_clusters_derive_the_same_example_order_and_shards_fit() -> None:
    ids = example_ids(seed=3, step=5, micro_batch=1, micro_batches=2, micro_batch_size=16)
    assert torch.equal(ids, example_ids(seed=3, step=5, micro_batch=1, micro_batches=2, micro_batch_size=16))
    assert not torch.equal(
        ids, example_ids(seed=3, step=5, micro_batch=0, micro_batches=2, micro_batch_size=16)
    )
    source, target = SourceShard().batch(ids), TargetShard().batch(ids)
    assert source.shape == (16, SOURCE_LEN) and target.shape == (16, TARGET_LEN)
    assert (target == EOS).sum() == 16  # every target ends exactly once


def test_split_step_equals_the_unsplit_model_step() -> None:
    """Cutting at the encoder output and feeding the returned gradient back is exact autograd."""
    torch.manual_seed(0)
    ids = example_ids(seed=0, step=0, micro_batch=0, micro_batches=1, micro_batch_size=8)
    source, target = SourceShard().batch(ids), TargetShard().batch(ids)

    def fresh() -> tuple[torch.nn.Module, torch.nn.Module]:
        return build_stage("encoder", 32, 4, 1, seed=1), build_stage("decoder", 32, 4, 1, seed=1)

    encoder, decoder = fresh()
    decoder.loss(encoder(source), target).backward()
    joint = [p.grad.clone() for p in [*encoder.parameters(), *decoder.parameters()]]

    encoder, decoder = fresh()
    states = encoder(source)
    memory = states.detach().requires_grad_(True)  # what arrives in the other cluster
    decoder.loss(memory, target).backward()
    states.backward(memory.grad)  # what comes back across the WAN
    split = [p.grad for p in [*encoder.parameters(), *decoder.parameters()]]

    assert len(joint) == len(split)
    for expected, actual in zip(joint, split, strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_unknown_stage_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown ABNet stage 'middle'"):
        build_stage("middle", 32, 4, 1, seed=0)
