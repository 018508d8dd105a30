"""Hot start (the paper's Figure 8): one stage's full training state, carried from one run into another.

A job can train its first N steps in one process (``reference.run_unsplit``,
one cluster) and continue across two clusters. For the continuation to be the
same step sequence, not just the same weights, each stage needs its model AND
its optimizer (Adam moments, step counts) AND its LR scheduler position. This
module defines that state's wire form (``ProgramStage.initial_state`` in
``trainer.proto``: ``torch.save`` of a plain dict) and the checks made when a
trainer loads it, so a state of the wrong stage, step or shape fails before step
one with an error that names what does not fit, instead of training garbage.

The SDK and the trainer both use these functions, so the two sides cannot
disagree about the layout.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from nebula_common.errors import InvalidRequestError
from nebula_common.jobspec.runtime import StageProgram

FORMAT = 1
KEYS = ("format", "stage", "step", "model", "optimizer", "scheduler")


class HotStartError(InvalidRequestError):
    """A hot-start state cannot be used for this stage; the message names the stage and what is wrong."""


def encode_stage_state(stage: str, step: int, program: StageProgram) -> bytes:
    """Serialize a stage's model, optimizer and scheduler state after ``step`` steps, tagged ``stage``."""
    return encode_state_dicts(
        stage,
        step,
        model=program.model.state_dict(),
        optimizer=program.optimizer.state_dict(),
        scheduler=program.scheduler.state_dict(),
    )


def encode_state_dicts(
    stage: str, step: int, *, model: dict[str, Any], optimizer: dict[str, Any], scheduler: dict[str, Any]
) -> bytes:
    """The ``initial_state`` bytes: ``torch.save`` of the dict documented in ``trainer.proto``."""
    buffer = io.BytesIO()
    state = {
        "format": FORMAT,
        "stage": stage,
        "step": int(step),
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
    }
    torch.save(state, buffer)
    return buffer.getvalue()


def decode_stage_state(data: bytes, stage: str, step: int) -> dict[str, Any]:
    """Read ``initial_state`` bytes meant for ``stage`` at ``step``; refuse anything else, naming it."""
    try:
        # weights_only: the bytes come from a client; never unpickle arbitrary objects in the trainer.
        state = torch.load(io.BytesIO(data), weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
        raise HotStartError(
            f"initial_state of stage {stage!r} is not a torch.save'd state dict: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(state, dict) or set(KEYS) - set(state):
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise HotStartError(
            f"initial_state of stage {stage!r} must be a dict with keys {', '.join(KEYS)}; got {found}"
        )
    if state["format"] != FORMAT:
        raise HotStartError(f"initial_state of stage {stage!r}: format {state['format']!r} is not {FORMAT}")
    if state["stage"] != stage:
        raise HotStartError(
            f"initial_state was made for stage {state['stage']!r}, not for stage {stage!r}: "
            "each cluster must receive its own stage's state"
        )
    if state["step"] != step:
        raise HotStartError(
            f"initial_state of stage {stage!r} holds the state after step {state['step']}, "
            f"but the job continues from step {step}"
        )
    scheduler_step = state["scheduler"].get("last_epoch") if isinstance(state["scheduler"], dict) else None
    if scheduler_step != step:
        raise HotStartError(
            f"initial_state of stage {stage!r}: the LR scheduler is at step {scheduler_step}, "
            f"not at the continuation step {step}"
        )
    return state


def _check_optimizer_shapes(stage: str, program: StageProgram, optimizer_state: dict[str, Any]) -> None:
    """torch's Optimizer.load_state_dict checks group sizes only; a moment of another shape would fail
    (or broadcast silently) mid-step, so compare every per-parameter state tensor with its parameter."""
    params = [p for group in program.optimizer.param_groups for p in group["params"]]
    saved = [i for group in optimizer_state.get("param_groups", []) for i in group.get("params", [])]
    if len(saved) != len(params):
        raise HotStartError(
            f"initial_state of stage {stage!r}: the optimizer state covers {len(saved)} parameters, "
            f"the stage's model has {len(params)} trainable ones"
        )
    per_param = optimizer_state.get("state", {})
    for position, (index, param) in enumerate(zip(saved, params, strict=True)):
        for name, value in per_param.get(index, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                raise HotStartError(
                    f"initial_state of stage {stage!r}: optimizer state {name!r} of parameter #{position} "
                    f"has shape {tuple(value.shape)}, the parameter has {tuple(param.shape)}"
                )


def apply_stage_state(program: StageProgram, state: dict[str, Any], stage: str) -> None:
    """Load a decoded state into a freshly built stage (model strictly: every key and shape must match)."""
    model = program.model.state_dict()
    given = state["model"]
    if not isinstance(given, dict):
        raise HotStartError(f"initial_state of stage {stage!r}: model must be a state dict")
    missing = sorted(set(model) - set(given))
    unexpected = sorted(set(given) - set(model))
    if missing or unexpected:
        raise HotStartError(
            f"initial_state of stage {stage!r} does not fit its model: missing {missing or 'none'}, "
            f"unexpected {unexpected or 'none'}"
        )
    for name, tensor in model.items():
        value = given[name]
        if not isinstance(value, torch.Tensor) or value.shape != tensor.shape:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise HotStartError(
                f"initial_state of stage {stage!r}: {name} has shape {shape}, "
                f"the stage's model has {tuple(tensor.shape)}"
            )
    _check_optimizer_shapes(stage, program, state["optimizer"])
    try:
        program.model.load_state_dict(given)
        program.optimizer.load_state_dict(state["optimizer"])
        program.scheduler.load_state_dict(state["scheduler"])
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise HotStartError(f"initial_state of stage {stage!r} does not load: {exc}") from exc


def load_stage_state(program: StageProgram, data: bytes, stage: str, step: int) -> None:
    """Decode ``initial_state`` bytes and load them into ``program`` (before the first step)."""
    apply_stage_state(program, decode_stage_state(data, stage, step), stage)
