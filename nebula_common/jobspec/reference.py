"""The same job trained unsplit in one process: the yardstick for the split run, and a hot-start source.

Every stage (two, or a chain of up to eight) lives in this process and the loss
backpropagates straight through the cuts, with the micro-batches of each step run one after the other. With
codec ``none``, a split run across clusters (any schedule) must reproduce these
per-step losses and final parameters; a run here can also produce the per-stage
state dicts a cross-cluster job starts from (the paper's Figure 8).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nebula_common.jobspec.hot_start import encode_state_dicts
from nebula_common.jobspec.loader import LoadedJob
from nebula_common.jobspec.runtime import OptimSettings, StageProgram, example_ids, load_program
from nebula_common.jobspec.spec import required_functions, stage_role


@dataclass
class UnsplitResult:
    losses: list[float] = field(default_factory=list)
    local_losses: list[float] = field(default_factory=list)  # one_way: the upstream stage's own loss
    state_dicts: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    # What a hot start needs besides the parameters, so the continuation is the same step sequence.
    optimizer_states: dict[str, dict[str, Any]] = field(default_factory=dict)
    scheduler_states: dict[str, dict[str, Any]] = field(default_factory=dict)
    steps: int = 0


def optim_settings(job: LoadedJob) -> OptimSettings:
    spec = job.spec
    return OptimSettings(
        name=spec.optimizer.name,
        lr=spec.optimizer.lr,
        weight_decay=spec.optimizer.weight_decay,
        momentum=spec.optimizer.momentum,
        schedule=spec.lr_schedule.name,
        warmup_steps=spec.lr_schedule.warmup_steps,
    )


def build_programs(job: LoadedJob) -> list[StageProgram]:
    """Every stage's program, in chain order (upstream first, the loss-owning stage last)."""
    spec = job.spec
    programs = []
    for index, stage in enumerate(spec.stages):
        required = required_functions(stage_role(index, len(spec.stages)), spec.pipeline.mode)
        module = job.modules[stage.name]
        programs.append(
            StageProgram(
                load_program(module.source, str(module.path), required),
                dict(stage.options),
                seed=spec.seed,
                stage_index=index,
                num_examples=spec.data.examples,
                optim=optim_settings(job),
                total_steps=spec.steps,
            )
        )
    return programs


def run_unsplit(job: LoadedJob, steps: int | None = None) -> UnsplitResult:
    """Train ``steps`` (default: the spec's) steps of the whole model in this process.

    In one_way mode (ELECTRA) the upstream stage backpropagates its own loss and
    the downstream stage trains on the upstream output with no gradient across
    the cut; data-parallel replicas are one process here, with the combined batch.
    """
    spec = job.spec
    programs = build_programs(job)
    upstream, middles, downstream = programs[0], programs[1:-1], programs[-1]
    micro_batches = spec.data.micro_batches
    size = spec.data.batch_size // micro_batches
    one_way = spec.pipeline.mode == "one_way"
    result = UnsplitResult()
    for step in range(spec.steps if steps is None else steps):
        total = local = 0.0
        for mb in range(micro_batches):
            ids = example_ids(spec.seed, spec.data.examples, step, mb, micro_batches, size)
            if one_way:
                states, own = upstream.produce(upstream.batch(ids))
                own = own / micro_batches
                own.backward()
                local += own.item()
            else:
                states = upstream.forward(upstream.batch(ids))
                for middle in middles:  # a chain: each middle stage turns what it got into what it sends
                    states = middle.relay(states, ids)
            loss = downstream.loss(states, downstream.batch(ids)) / micro_batches
            loss.backward()
            total += loss.item()
        for program in programs:
            program.finish_step()
        result.losses.append(total)
        if one_way:
            result.local_losses.append(local)
    pairs = [(stage.name, program) for stage, program in zip(spec.stages, programs, strict=True)]
    result.state_dicts = {name: program.model.state_dict() for name, program in pairs}
    result.optimizer_states = {name: program.optimizer.state_dict() for name, program in pairs}
    result.scheduler_states = {name: program.scheduler.state_dict() for name, program in pairs}
    result.steps = len(result.losses)
    return result


def hot_start_states(result: UnsplitResult) -> dict[str, bytes]:
    """Each stage's ``ProgramStage.initial_state`` bytes after this run (model, optimizer, scheduler)."""
    return {
        stage: encode_state_dicts(
            stage,
            result.steps,
            model=model,
            optimizer=result.optimizer_states[stage],
            scheduler=result.scheduler_states[stage],
        )
        for stage, model in result.state_dicts.items()
    }


def save_state_dicts(result: UnsplitResult, directory: Path) -> dict[str, Path]:
    """Write each stage's parameters as a plain torch state dict (``<stage>.pt``)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for stage, state in result.state_dicts.items():
        paths[stage] = directory / f"{stage}.pt"
        torch.save(state, paths[stage])
    return paths
