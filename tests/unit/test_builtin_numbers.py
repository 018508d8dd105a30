"""The numbers built-in job (the demo's): its task data, and what the runtime relies on across the cut."""

from __future__ import annotations

import pytest
import torch

from nebula_common.jobspec import load_spec
from nebula_common.jobspec.builtin import builtin_spec
from nebula_common.jobspec.reference import build_programs
from nebula_common.jobspec.runtime import StageProgram, example_ids
from nebula_common.sdk.jobs import ProgramJob
from nebula_common.zoo.numbers import EOS, MAX_NUMBER, SOURCE_LEN, TARGET_LEN, number_to_words

pytestmark = pytest.mark.timeout(60)
SMALL = {"stages.0.options.d_model": 32, "stages.1.options.d_model": 32, "data.micro_batches": 1}


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


def programs() -> tuple[StageProgram, StageProgram]:
    """Both stages of the numbers job as its own modules build them (seeded per stage, like the trainers)."""
    return build_programs(load_spec(builtin_spec("numbers"), SMALL))


def test_both_clusters_derive_the_same_example_order_and_shards_fit() -> None:
    examples = load_spec(builtin_spec("numbers")).spec.data.examples
    assert examples == MAX_NUMBER + 1  # example id n is the number n on both sides
    ids = example_ids(3, examples, step=5, micro_batch=1, micro_batches=2, micro_batch_size=16)
    assert ids == example_ids(3, examples, step=5, micro_batch=1, micro_batches=2, micro_batch_size=16)
    assert ids != example_ids(3, examples, step=5, micro_batch=0, micro_batches=2, micro_batch_size=16)
    source, target = (program.batch(ids) for program in programs())
    assert source.shape == (16, SOURCE_LEN) and target.shape == (16, TARGET_LEN)
    assert (target == EOS).sum() == 16  # every target ends exactly once
    digits = ["".join(str(int(t) - 3) for t in row if t) for row in source]  # vocab: pad, bos, eos, 0-9
    assert [int(d) for d in digits] == ids  # the source row of example n is n's digits


def test_split_step_equals_the_unsplit_model_step() -> None:
    """Cutting at the encoder output and feeding the returned gradient back is exact autograd."""
    ids = example_ids(0, MAX_NUMBER + 1, step=0, micro_batch=0, micro_batches=1, micro_batch_size=8)

    encoder, decoder = programs()
    decoder.loss(encoder.forward(encoder.batch(ids)), decoder.batch(ids)).backward()
    joint = [p.grad.clone() for p in [*encoder.model.parameters(), *decoder.model.parameters()]]

    encoder, decoder = programs()
    states = encoder.forward(encoder.batch(ids))
    memory = states.detach().requires_grad_(True)  # what arrives in the other cluster
    decoder.loss(memory, decoder.batch(ids)).backward()
    states.backward(memory.grad)  # what comes back across the WAN
    split = [p.grad for p in [*encoder.model.parameters(), *decoder.model.parameters()]]

    assert len(joint) == len(split)
    for expected, actual in zip(joint, split, strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_unknown_stage_is_an_error() -> None:
    job = ProgramJob(load_spec(builtin_spec("numbers")), job_id="j1")
    with pytest.raises(ValueError, match="no stage 'middle'"):
        job.stage_spec("middle")
