"""A chain's middle stage on 2 data-parallel ranks equals it on 1 rank with the combined batch.

The middle stage (``examples/chain``'s mixer) runs as a real ``ProgramRunner`` whose
``DataParallelGroup`` spawns a second rank process (real gloo): rank 0 holds both of the
middle's edges, scatters each micro-batch's rows, and gathers the ranks' output rows (forward)
and the gradient rows of what it received (backward); the ranks sum their parameter gradients
at each step. Losses and every stage's final parameters must equal the single-process chain
(and so the unsplit model) within 1e-5.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nebula_common.jobspec import SpecError, load_spec
from nebula_common.jobspec.reference import run_unsplit
from nebula_common.sdk.jobs import ProgramJob
from services.trainer.runtime.parallel import DataParallelGroup
from services.trainer.validation import validate_stage_spec
from tests.unit.test_stage_chain import EXAMPLE, chain_fields, chain_job, check_equals_unsplit, run_chain

pytestmark = pytest.mark.timeout(300)
STEPS = 4


def middle_on_ranks(replicas: int, **top: object) -> ProgramJob:
    spec = chain_job(3, STEPS, **top).spec.model_dump(mode="json", by_alias=True)
    spec["stages"][1]["replicas"] = replicas
    return ProgramJob(load_spec(spec, base_dir=EXAMPLE.parent))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_middle_stage_on_two_ranks_equals_one_rank_with_the_combined_batch(
    tmp_path: Path, schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SGD, as the other data-parallel tests: Adam would turn float-reassociation noise in near-zero
    # gradients (summed over 2 ranks instead of computed at once) into full-size steps.
    top = {
        "pipeline": {"schedule": schedule, "max_in_flight": 2},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    }
    job = middle_on_ranks(2, **top)
    assert job.stage_spec("mixer1").program.replicas == 2
    relayed: list[tuple[int, int]] = []
    real_relay = DataParallelGroup.relay

    def counted(group: DataParallelGroup, step: int, micro_batch: int, *rest: Any) -> Any:
        relayed.append((step, micro_batch))  # the micro-batch did go through the ranks
        return real_relay(group, step, micro_batch, *rest)

    monkeypatch.setattr(DataParallelGroup, "relay", counted)
    runs = run_chain(job, tmp_path)
    assert sorted(relayed) == [(s, mb) for s in range(STEPS) for mb in range(2)]
    one_rank = middle_on_ranks(1, **top)
    reference = run_unsplit(one_rank.loaded)  # the 1-rank chain equals unsplit (test_stage_chain)
    assert reference.losses[-1] != reference.losses[0]  # it trained
    check_equals_unsplit(runs, reference, STEPS)
    assert runs[1].final.bytes_sent > 0 and len(runs[1].final.edges) == 2


def test_a_middle_stage_may_be_sharded_and_its_sharding_is_checked() -> None:
    fields = chain_fields(3)
    fields["stages"][1].update(replicas=2, parallel="fsdp")
    base = load_spec(EXAMPLE).spec.model_dump(mode="json", by_alias=True)
    base.update(fields)
    job = ProgramJob(load_spec(base, base_dir=EXAMPLE.parent))
    validate_stage_spec(job.stage_spec("mixer1"))  # what the trainer checks before it runs the stage
    assert job.stage_spec("mixer1").program.parallel == "fsdp"
    fields["stages"][1].update(replicas=1)
    base.update(fields)
    with pytest.raises(SpecError, match=r"stages\.1\.parallel: fsdp shards a stage across its replicas"):
        load_spec(base, base_dir=EXAMPLE.parent)
