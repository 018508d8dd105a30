"""Building a program stage from its StageSpec: the stage's module, model and starting state.

Why a module of its own: the trainer's stage thread (``stage.py``), every data-parallel
replica process (``parallel.py``) and spec validation all build or check a stage the same
way, and none of them may import the others for it (that was an import circle).
"""

from __future__ import annotations

import json

from nebula_common.jobspec.hot_start import load_stage_state
from nebula_common.jobspec.runtime import (
    ExampleSource,
    OptimSettings,
    ProgramError,
    StageProgram,
    example_ids,
    load_program,
)
from nebula_common.jobspec.spec import required_functions
from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer.runtime.checkpoint import CheckpointStore


def hot_start_problems(spec: trainer_pb2.StageSpec) -> list[str]:
    """What is wrong with a stage spec's hot-start fields (empty: nothing), each naming the field.

    Cheap checks only (no unpickling): the state itself is checked against the
    built model when the stage starts, where a mismatch names the tensor.
    """
    cfg = spec.program
    if not cfg.initial_state:
        return (
            [f"program.initial_step {cfg.initial_step} needs program.initial_state"]
            if cfg.initial_step
            else []
        )
    problems = []
    if cfg.resume_job_id:
        problems.append("program.initial_state and program.resume_job_id are exclusive (one starting state)")
    if not 1 <= cfg.initial_step < spec.steps:
        problems.append(f"program.initial_step {cfg.initial_step} must be in 1..{spec.steps - 1} (steps - 1)")
    return problems


def load_starting_state(
    spec: trainer_pb2.StageSpec, program: StageProgram, store: CheckpointStore, owner: str
) -> int:
    """Load a resume checkpoint or a hot-start state into a freshly built stage; the first step to run."""
    cfg = spec.program
    problems = hot_start_problems(spec)
    if problems:
        raise ProgramError("; ".join(problems))
    if cfg.initial_state:
        load_stage_state(program, cfg.initial_state, spec.stage, int(cfg.initial_step))
        return int(cfg.initial_step)
    if cfg.resume_job_id:
        store.load(cfg.resume_job_id, spec.stage, cfg.resume_step, owner, program)
        return int(cfg.resume_step)
    return 0


def build_program(spec: trainer_pb2.StageSpec, examples_source: ExampleSource | None = None) -> StageProgram:
    """Load this stage's module (only this stage's) and build its model, shard and optimizer."""
    cfg = spec.program
    required = required_functions(cfg.role, cfg.mode or "backprop")
    module = load_program(cfg.module_source, cfg.module_name or f"<{spec.stage}>", required)
    opt = cfg.optimizer
    return StageProgram(
        module,
        json.loads(cfg.options_json or "{}"),
        seed=cfg.seed,
        stage_index=cfg.stage_index,
        num_examples=cfg.num_examples,
        optim=OptimSettings(
            name=opt.name,
            lr=opt.learning_rate,
            weight_decay=opt.weight_decay,
            momentum=opt.momentum,
            schedule=opt.lr_schedule,
            warmup_steps=opt.warmup_steps,
        ),
        total_steps=spec.steps,
        examples_source=examples_source,
    )


def micro_batch_ids(cfg: trainer_pb2.ProgramStage, step: int, micro_batch: int) -> list[int]:
    """The example ids of one micro-batch of a step: the same in every cluster, so the stages agree."""
    size = cfg.batch_size // cfg.micro_batches
    return example_ids(cfg.seed, cfg.num_examples, step, micro_batch, cfg.micro_batches, size)


__all__ = ["build_program", "hot_start_problems", "load_starting_state", "micro_batch_ids"]
