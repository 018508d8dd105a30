"""What every process that runs a stage agrees on: module loading, example order, optimizer, LR schedule.

The split run (one stage per trainer) and the unsplit reference run (both
stages in one process) use exactly these functions, so "split equals unsplit"
is a statement about the transport and the schedule, not about two copies of
the training logic drifting apart.
"""

from __future__ import annotations

import itertools
import math
import sys
import threading
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

import torch
from torch import nn

from nebula_common.errors import InvalidRequestError

Batch = Any  # whatever the user's collate returns (a tensor or a tuple of tensors)
_loaded = itertools.count()
# Parameter init uses torch's global RNG; a trainer may build several jobs' stages concurrently.
_BUILD_LOCK = threading.Lock()


class ProgramError(InvalidRequestError):
    """A stage module failed to load or broke its contract (message names the function)."""


def load_program(source: str, filename: str, required: Sequence[str]) -> types.ModuleType:
    """Execute a stage module's source as a fresh module; check it defines ``required`` callables.

    The module gets a unique name in ``sys.modules`` so classes it defines can be
    pickled and introspected like any imported module's.
    """
    name = f"nebula_stage_{next(_loaded)}"
    module = types.ModuleType(name)
    module.__file__ = filename
    sys.modules[name] = module
    try:
        exec(compile(source, filename, "exec"), module.__dict__)
    except Exception as exc:
        del sys.modules[name]
        raise ProgramError(f"stage module {filename} failed to load: {type(exc).__name__}: {exc}") from exc
    missing = [fn for fn in required if not callable(getattr(module, fn, None))]
    if missing:
        raise ProgramError(f"stage module {filename} must define callable(s): {', '.join(missing)}")
    return module


@lru_cache(maxsize=8)
def _epoch_order(seed: int, epoch: int, num_examples: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_examples, generator=generator)


def example_ids(
    seed: int, num_examples: int, step: int, micro_batch: int, micro_batches: int, micro_batch_size: int
) -> list[int]:
    """Example ids of one micro-batch: a fresh seeded permutation per epoch, identical in every cluster."""
    start = (step * micro_batches + micro_batch) * micro_batch_size
    ids = []
    for position in range(start, start + micro_batch_size):
        epoch, index = divmod(position, num_examples)
        ids.append(int(_epoch_order(seed, epoch, num_examples)[index]))
    return ids


def lr_factor(schedule: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the base learning rate at each step (for LambdaLR)."""
    if schedule not in ("constant", "linear_warmup", "cosine"):
        raise ValueError(f"unknown lr schedule {schedule!r}")

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "cosine":
            span = max(total_steps - warmup_steps, 1)
            return 0.5 * (1.0 + math.cos(math.pi * min(step - warmup_steps, span) / span))
        return 1.0

    return factor


def build_optimizer(
    params: list[nn.Parameter] | list[dict[str, Any]],
    name: str,
    lr: float,
    weight_decay: float,
    momentum: float,
) -> torch.optim.Optimizer:
    """The stage's optimizer over ``params``: parameters, or param groups (a group's own ``lr`` wins)."""
    if not params:
        raise ProgramError("the stage has no trainable parameters (every parameter has requires_grad=False)")
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay, momentum=momentum)
    raise ValueError(f"unknown optimizer {name!r}")


@dataclass
class OptimSettings:
    name: str
    lr: float
    weight_decay: float
    momentum: float
    schedule: str
    warmup_steps: int


class ExampleSource(Protocol):
    """Examples read batch by batch from elsewhere (a granted dataset): never held whole by the stage."""

    def __len__(self) -> int: ...

    def batch(self, example_ids: Sequence[int]) -> list[Any]: ...


class StageProgram:
    """One stage of a job inside one process: the user's functions, its model, data shard and optimizer."""

    def __init__(
        self,
        module: types.ModuleType,
        options: dict[str, Any],
        *,
        seed: int,
        stage_index: int,
        num_examples: int,
        optim: OptimSettings,
        total_steps: int,
        examples_source: ExampleSource | None = None,
    ) -> None:
        self.module = module
        self.options = options
        with _BUILD_LOCK:
            torch.manual_seed(seed + stage_index)  # parameters: identical in every run with this seed
            model = module.build(options)
        if not isinstance(model, nn.Module):
            raise ProgramError(f"build() must return a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        examples: Sequence[Any] | ExampleSource = (
            examples_source if examples_source is not None else module.load_examples(options)
        )
        if len(examples) != num_examples:
            origin = "the granted dataset has" if examples_source is not None else "load_examples() returned"
            raise ProgramError(
                f"{origin} {len(examples)} examples but the spec says data.examples = "
                f"{num_examples}; both clusters must index the same example ids"
            )
        self.examples = examples
        self._source = examples_source
        self._optim = optim
        self._total_steps = total_steps
        self.rebuild_optimizer()

    def rebuild_optimizer(self) -> None:
        """A fresh optimizer and LR schedule over the model's current trainable parameters.

        Called once at build, and again by a sharded stage after FSDP replaced the parameters with
        their shards (an optimizer holds parameter objects, so it must be built over the new ones).
        """
        optim = self._optim
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        groups = self._param_groups(trainable)
        self.optimizer = build_optimizer(groups, optim.name, optim.lr, optim.weight_decay, optim.momentum)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_factor(optim.schedule, optim.warmup_steps, self._total_steps)
        )

    def _param_groups(self, trainable: list[nn.Parameter]) -> list[nn.Parameter] | list[dict[str, Any]]:
        """Trainable parameters, split by the module's optional ``param_groups(model, options)``.

        That hook returns groups ``{"params": [...], "lr": x}`` for parameters that train at their own
        rate (the ABNet job's learned bottleneck, ``cut_lr``); every other trainable parameter stays in
        the first group at the stage's rate. The schedule scales every group alike. Parameters the hook
        names that are not trainable parameters of the model (frozen, or replaced by shards) are skipped.
        """
        hook = getattr(self.module, "param_groups", None)
        if not callable(hook):
            return trainable
        known = {id(p) for p in trainable}
        taken: set[int] = set()
        own: list[dict[str, Any]] = []
        for group in hook(self.model, self.options) or []:
            lr = group.get("lr") if isinstance(group, dict) else None
            if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (lr > 0 and math.isfinite(lr)):
                raise ProgramError(f"param_groups() must give each group a positive finite lr, got {lr!r}")
            params = [p for p in group.get("params", []) if id(p) in known and id(p) not in taken]
            taken.update(id(p) for p in params)
            if params:
                own.append({"params": params, "lr": float(lr)})
        if not own:
            return trainable
        rest = [p for p in trainable if id(p) not in taken]
        return ([{"params": rest}] if rest else []) + own

    def batch(self, ids: Sequence[int]) -> Batch:
        if self._source is not None:  # one read per micro-batch; the owner's grant is checked each time
            return self.module.collate(self._source.batch([int(i) for i in ids]))
        return self.module.collate([self.examples[i] for i in ids])

    def forward(self, batch: Batch) -> torch.Tensor:
        """Upstream: the tensor that crosses the edge."""
        custom = getattr(self.module, "forward", None)
        if callable(custom):
            out = custom(self.model, batch)
        elif isinstance(batch, tuple):
            out = self.model(*batch)
        else:
            out = self.model(batch)
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            raise ProgramError("the upstream stage must produce one floating-point tensor to send")
        return out

    def relay(self, received: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
        """A middle stage of a chain: its output for what arrived from upstream (sent downstream).

        ``forward(model, received, batch)`` if the module defines it (the batch is read only then),
        else ``model(received)``.
        """
        custom = getattr(self.module, "forward", None)
        out = custom(self.model, received, self.batch(ids)) if callable(custom) else self.model(received)
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            raise ProgramError("a middle stage must produce one floating-point tensor to send downstream")
        return out

    def produce(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """One-way upstream (ELECTRA generator): what crosses the edge, and this stage's own scalar loss."""
        result = self.module.produce(self.model, batch)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise ProgramError("produce() must return a tuple (tensor to send, scalar loss)")
        out, loss = result
        if not isinstance(out, torch.Tensor):
            raise ProgramError(f"produce() must return a tensor to send first, got {type(out).__name__}")
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ProgramError("produce() must return a scalar loss tensor second")
        return out.detach(), loss

    def loss(self, received: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Downstream: the scalar loss of one micro-batch given what arrived over the edge."""
        value = self.module.loss(self.model, received, batch)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            raise ProgramError("loss() must return a scalar tensor")
        return value

    def finish_step(self) -> None:
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
