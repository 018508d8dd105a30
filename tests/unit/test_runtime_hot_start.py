"""Hot start (paper Fig. 8): a stage's state from an unsplit run loads exactly, and bad state is named.

The trainer-side path under test is the real one: ``ProgramJob.stage_spec`` builds
the StageSpec a cluster receives, ``build_program`` + ``load_starting_state`` are
what ``ProgramRunner`` runs before its first step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from nebula_common.errors import InvalidRequestError
from nebula_common.jobspec import LoadedJob, load_spec
from nebula_common.jobspec.hot_start import HotStartError, decode_stage_state, encode_state_dicts
from nebula_common.jobspec.reference import hot_start_states, run_unsplit
from nebula_common.jobspec.runtime import ProgramError, StageProgram
from nebula_common.sdk.jobs import MAX_STAGE_SPEC_BYTES, ProgramJob
from services.trainer.runtime.checkpoint import CheckpointStore
from services.trainer.runtime.program import build_program, hot_start_problems, load_starting_state

pytestmark = pytest.mark.timeout(60)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digit_sum" / "job.yaml"


def example(**overrides: Any) -> LoadedJob:
    return load_spec(EXAMPLE, {"steps": 4, "data.examples": 20000, **overrides})


def started(job: ProgramJob, stage: str, tmp_path: Path) -> StageProgram:
    """Build the stage as its trainer would from the spec it receives, and load its starting state."""
    spec = job.stage_spec(stage)
    program = build_program(spec)
    assert load_starting_state(spec, program, CheckpointStore(tmp_path), "alice") == job.initial_step
    return program


def test_loaded_state_is_the_unsplit_runs_model_optimizer_and_scheduler(tmp_path: Path) -> None:
    job, local = ProgramJob.hot_started(example(), 2)
    for stage in ("reader", "head"):
        program = started(job, stage, tmp_path)
        for name, tensor in program.model.state_dict().items():
            torch.testing.assert_close(tensor, local.state_dicts[stage][name], rtol=0, atol=0)
        moments = [s["exp_avg"] for s in program.optimizer.state_dict()["state"].values()]
        saved = [s["exp_avg"] for s in local.optimizer_states[stage]["state"].values()]
        assert moments and all(torch.equal(a, b) for a, b in zip(moments, saved, strict=True))
        assert program.scheduler.last_epoch == 2  # the warmup continues at step 2, not from 0


def test_each_stage_spec_carries_only_its_own_state() -> None:
    job, _ = ProgramJob.hot_started(example(), 1)
    for stage in ("reader", "head"):
        cfg = job.stage_spec(stage).program
        assert cfg.initial_step == 1
        assert decode_stage_state(cfg.initial_state, stage, 1)["stage"] == stage


def test_state_of_the_other_stage_is_refused_naming_both(tmp_path: Path) -> None:
    states = hot_start_states(run_unsplit(example(), 1))
    swapped = ProgramJob(
        example(), initial_states={"reader": states["head"], "head": states["reader"]}, initial_step=1
    )
    spec = swapped.stage_spec("head")
    with pytest.raises(HotStartError, match="made for stage 'reader', not for stage 'head'"):
        load_starting_state(spec, build_program(spec), CheckpointStore(tmp_path), "alice")


def test_state_of_another_shape_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    states = hot_start_states(run_unsplit(example(), 1))  # reader width 64
    narrow = ProgramJob(example(**{"stages.0.options.width": 32}), initial_states=states, initial_step=1)
    spec = narrow.stage_spec("reader")
    with pytest.raises(
        HotStartError,
        match=r"stage 'reader': embed.weight has shape \(10, 64\), the stage's model has \(10, 32\)",
    ):
        load_starting_state(spec, build_program(spec), CheckpointStore(tmp_path), "alice")


def test_optimizer_moments_of_another_shape_are_refused(tmp_path: Path) -> None:
    local = run_unsplit(example(), 1)
    optimizer = local.optimizer_states["head"]
    first = next(iter(optimizer["state"].values()))
    first["exp_avg"] = torch.zeros(3, 3)
    bad = encode_state_dicts(
        "head",
        1,
        model=local.state_dicts["head"],
        optimizer=optimizer,
        scheduler=local.scheduler_states["head"],
    )
    states = {**hot_start_states(local), "head": bad}
    spec = ProgramJob(example(), initial_states=states, initial_step=1).stage_spec("head")
    with pytest.raises(HotStartError, match="optimizer state 'exp_avg' of parameter #0 has shape \\(3, 3\\)"):
        load_starting_state(spec, build_program(spec), CheckpointStore(tmp_path), "alice")


def test_state_after_another_step_and_garbage_bytes_are_refused() -> None:
    data = hot_start_states(run_unsplit(example(), 1))["reader"]
    with pytest.raises(HotStartError, match="after step 1, but the job continues from step 2"):
        decode_stage_state(data, "reader", 2)
    with pytest.raises(HotStartError, match=r"stage 'reader' is not a torch\.save'd state dict"):
        decode_stage_state(b"not a torch file", "reader", 1)


def test_sdk_refuses_a_missing_stage_a_resume_a_bad_step_and_an_oversized_state() -> None:
    states = hot_start_states(run_unsplit(example(), 1))
    with pytest.raises(InvalidRequestError, match="need the state of every stage"):
        ProgramJob(example(), initial_states={"reader": states["reader"]}, initial_step=1)
    with pytest.raises(InvalidRequestError, match="hot start and resume are exclusive"):
        ProgramJob(example(), initial_states=states, initial_step=1, resume_job_id="old", resume_step=1)
    with pytest.raises(InvalidRequestError, match=r"initial_step 4 must be in 1\.\.3"):
        ProgramJob(example(), initial_states=states, initial_step=4)
    with pytest.raises(InvalidRequestError, match=r"4 unsplit steps must be in 1\.\.3"):
        ProgramJob.hot_started(example(), 4)
    huge = {**states, "head": bytes(MAX_STAGE_SPEC_BYTES)}
    with pytest.raises(
        InvalidRequestError,
        match=r"stage 'head' spec with its initial state is 67,0\d\d,\d\d\d bytes; "
        r"a stage spec must stay under 67,043,328 bytes",
    ):
        ProgramJob(example(), initial_states=huge, initial_step=1)


def test_trainer_refuses_inconsistent_hot_start_fields(tmp_path: Path) -> None:
    job, _ = ProgramJob.hot_started(example(), 1)
    spec = job.stage_spec("reader")
    assert hot_start_problems(spec) == []
    spec.program.resume_job_id = "old"
    spec.program.initial_step = 4
    problems = hot_start_problems(spec)
    assert any("exclusive" in p for p in problems) and any(
        "initial_step 4 must be in 1..3" in p for p in problems
    )
    with pytest.raises(ProgramError, match="exclusive"):
        load_starting_state(spec, build_program(spec), CheckpointStore(tmp_path), "alice")
    spec.program.initial_state = b""
    spec.program.resume_job_id = ""
    assert hot_start_problems(spec) == ["program.initial_step 4 needs program.initial_state"]
