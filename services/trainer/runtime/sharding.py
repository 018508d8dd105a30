"""Sharded stages: a stage's ranks hold 1/n of its parameters (FSDP2), or shard in groups (HSDP).

Why FSDP2 (``torch.distributed.fsdp.fully_shard``) and not a Nebula scheme: each parameter becomes
a DTensor sharded on dim 0 over a DeviceMesh; the forward all-gathers, the backward
reduce-scatters, and the optimizer steps only the local shard, so parameter, gradient and
optimizer memory per rank fall with the number of ranks. ``hsdp`` uses a 2-D mesh
``(replicate, shard)`` as DHEN does inside a host group: parameters are sharded across the
``shard`` dimension and replicated across ``replicate``, so gradients are reduce-scattered inside a
shard group and all-reduced between groups.

The user's ``loss(model, received, batch)`` may call submodules directly instead of
``model(...)``, so the FSDP root is a small module whose ``forward`` *is* the user's loss (or, on an
upstream stage, the user's forward): its pre-forward hook gathers every parameter before any user
code runs, whatever it touches. The model itself is not wrapped separately (no inner FSDP
units): arbitrary user modules may share or reach into each other's parameters, which inner units
would break; the cost is that a rank holds the whole model unsharded during its compute only.

Checkpoints of sharded stages go through ``torch.distributed.checkpoint`` (DCP): every rank writes
its own shards plus a global metadata file, and a load reshards to whatever ranks (or the single
unsharded process) load it. That is what lets a job saved on 2 ranks resume on 1 or on 4.

The process group: FSDP2, DeviceMesh and DCP work on torch.distributed's default group, so every
rank of a sharded stage is a process of its own (never the trainer, which runs other jobs'
stages); see ``services/trainer/runtime/sharded.py``.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from nebula_common.jobspec.runtime import StageProgram

# FSDP2, DeviceMesh, DTensor and DCP are imported where a sharded stage or a sharded checkpoint
# needs them, not here: together they cost about a second of every trainer start (and restart),
# and only a sharded stage's rank processes, or a resume from a sharded checkpoint, use them.
if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule

PARALLEL = ("ddp", "fsdp", "hsdp")
SHARDED = ("fsdp", "hsdp")


class ShardingError(RuntimeError):
    """A sharded stage could not be set up, or a sharded checkpoint could not be written or read."""


def backend_for(device_type: str) -> str:
    """The collective backend for a device: NCCL on CUDA, gloo on CPU."""
    return "nccl" if device_type == "cuda" else "gloo"


def stage_mesh(parallel: str, world: int, shard_size: int, device_type: str = "cpu") -> DeviceMesh:
    """The device mesh of a sharded stage over the default group's ``world`` ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    if parallel == "fsdp":
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    if parallel == "hsdp":
        if shard_size < 2 or world % shard_size or shard_size >= world:
            raise ShardingError(f"hsdp: shard_size {shard_size} must divide {world} ranks and be below it")
        return init_device_mesh(
            device_type, (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard")
        )
    raise ShardingError(f"parallel {parallel!r} is not sharded (one of {', '.join(SHARDED)})")


class LossRoot(nn.Module):
    """The root DDP or FSDP wraps on a stage that owns the loss: its forward is the user's loss, so the
    wrapper syncs the gradients of everything that runs through it (see the module doc)."""

    def __init__(self, program: StageProgram) -> None:
        super().__init__()
        self.model = program.model
        self._loss: Callable[[torch.Tensor, Any], torch.Tensor] = program.loss

    def forward(self, received: torch.Tensor, batch: Any) -> torch.Tensor:
        return self._loss(received, batch)


class ForwardRoot(nn.Module):
    """FSDP root of an upstream stage: its forward is the user's forward (the tensor that crosses)."""

    def __init__(self, program: StageProgram) -> None:
        super().__init__()
        self.model = program.model
        self._forward: Callable[[Any], torch.Tensor] = program.forward

    def forward(self, batch: Any) -> torch.Tensor:
        return self._forward(batch)


class RelayRoot(nn.Module):
    """FSDP root of a chain's middle stage: its forward is the user's relay (what is sent below)."""

    def __init__(self, program: StageProgram) -> None:
        super().__init__()
        self.model = program.model
        self._relay: Callable[[torch.Tensor, Any], torch.Tensor] = program.relay

    def forward(self, received: torch.Tensor, ids: list[int]) -> torch.Tensor:
        return self._relay(received, ids)


def to_device(value: Any, device: torch.device) -> Any:
    """A batch (a tensor, or a tuple/list of them) on the stage's device (a no-op on CPU)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple | list):
        return type(value)(to_device(item, device) for item in value)
    return value


def shard_program(
    program: StageProgram, mesh: DeviceMesh, *, upstream: bool, middle: bool = False
) -> FSDPModule:
    """Shard ``program``'s model over ``mesh`` in place; its optimizer is rebuilt over the shards.

    Downstream, the gradient reduction averages over the ranks (each rank's loss is the mean of
    its rows, so the average is the combined batch's gradient, as with DDP). Upstream (and on a
    chain's middle stage), each rank backpropagates its rows' share of the combined loss's
    gradient, so the shares are summed.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    root: nn.Module
    if middle:
        root, upstream = RelayRoot(program), True  # reduced as upstream: the shares are summed
    else:
        root = ForwardRoot(program) if upstream else LossRoot(program)
    sharded = fully_shard(root, mesh=mesh)
    if not isinstance(sharded, FSDPModule):  # fully_shard returns the module it changed the class of
        raise ShardingError("fully_shard did not return an FSDP module")
    if mesh.device_type == "cpu":
        # gloo has no PREMUL_SUM (what a custom divide factor becomes) and a history of a silently
        # wrong AVG (pytorch/pytorch#162338): reduce with plain SUM, scaling before/after it.
        sharded.set_force_sum_reduction_for_comms(True)
    if upstream:
        sharded.set_gradient_divide_factor(1.0)
    program.rebuild_optimizer()
    return sharded


class ShardedCompute:
    """One rank's share of a downstream micro-batch on a sharded stage (the FSDP twin of DDP's).

    Gradients accumulate locally over a step's micro-batches and are reduced once, in the last
    micro-batch's backward (``set_requires_gradient_sync``, FSDP2's ``no_sync``).
    """

    def __init__(self, program: StageProgram, mesh: DeviceMesh, micro_batches: int, backprop: bool) -> None:
        self.program = program
        self.micro_batches = micro_batches
        self.backprop = backprop
        self.root = shard_program(program, mesh, upstream=False)
        self.device = torch.device(mesh.device_type)

    def run(self, rows: torch.Tensor, ids: list[int], last: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        received = rows.requires_grad_(True) if self.backprop else rows
        self.root.set_requires_gradient_sync(last)
        self.root.set_is_last_backward(last)
        loss = self.root(received, to_device(self.program.batch(ids), self.device)) / self.micro_batches
        loss.backward()
        return loss.detach().reshape(1), received.grad if self.backprop else None


class _StepBackwards:
    """A sharded root whose step's backwards are counted: the parameter gradients accumulate locally
    and are reduced in the step's last backward, whichever micro-batch that is (under 1F1B the
    backwards do not come in forward order)."""

    def __init__(self, program: StageProgram, mesh: DeviceMesh, micro_batches: int, *, middle: bool) -> None:
        self.program = program
        self.micro_batches = micro_batches
        self.root = shard_program(program, mesh, upstream=True, middle=middle)
        self.device = torch.device(mesh.device_type)
        self._backwards = 0

    def _backward(self, out: torch.Tensor, grad: torch.Tensor) -> None:
        """``out.backward(grad)``, reducing the parameter gradients if this is the step's last backward."""
        if grad.shape != out.shape:
            raise ShardingError(f"gradient rows {tuple(grad.shape)} != output rows {tuple(out.shape)}")
        self._backwards += 1
        last = self._backwards == self.micro_batches
        self.root.set_requires_gradient_sync(last)
        self.root.set_is_last_backward(last)
        out.backward(grad.to(device=out.device, dtype=out.dtype))
        if last:
            self._backwards = 0


class ShardedUpstream(_StepBackwards):
    """A rank's share of an upstream micro-batch on a sharded stage: output rows, then their backward.

    The gradient is reduced in the step's last backward, whichever micro-batch that is (under 1F1B
    the backwards do not come in forward order).
    """

    def __init__(self, program: StageProgram, mesh: DeviceMesh, micro_batches: int) -> None:
        super().__init__(program, mesh, micro_batches, middle=False)
        self._outputs: dict[int, torch.Tensor] = {}

    def forward(self, micro_batch: int, ids: list[int]) -> torch.Tensor:
        out = self.root(to_device(self.program.batch(ids), self.device))
        self._outputs[micro_batch] = out
        return out.detach().contiguous()

    def backward(self, micro_batch: int, grad: torch.Tensor) -> None:
        self._backward(self._outputs.pop(micro_batch), grad)


class ShardedMiddle(_StepBackwards):
    """A rank's share of a chain's middle stage when sharded: its rows relayed, then their backward.

    Like ``ShardedUpstream``, the parameter gradients are reduced (summed) in the step's last
    backward, whichever micro-batch that is; each backward also yields the gradient of the rows
    this rank received, which the driver gathers into the one it sends above.
    """

    def __init__(self, program: StageProgram, mesh: DeviceMesh, micro_batches: int) -> None:
        super().__init__(program, mesh, micro_batches, middle=True)
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, micro_batch: int, rows: torch.Tensor, ids: list[int]) -> torch.Tensor:
        received = rows.to(self.device).requires_grad_(True)
        out = self.root(received, ids)
        self._pending[micro_batch] = (received, out)
        return out.detach().contiguous()

    def backward(self, micro_batch: int, grad: torch.Tensor) -> torch.Tensor:
        received, out = self._pending.pop(micro_batch)
        self._backward(out, grad)
        if received.grad is None:
            raise ShardingError(
                "the middle stage's output does not depend on what it received: no gradient to send up"
            )
        return received.grad.contiguous()


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds (a sharded parameter counts its local shard only)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        total += local.numel() * local.element_size()
    return total


def full_parameters(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter whole, in order (a collective on a sharded model: every rank must call it)."""
    from torch.distributed.tensor import DTensor

    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]


def save_sharded(directory: Path, program: StageProgram) -> None:
    """Write the model's and optimizer's state with DCP (collective on a sharded stage: all ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(program.model, program.optimizer)
    try:
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(directory))
    except Exception as exc:
        raise ShardingError(f"cannot write the sharded checkpoint {directory}: {exc}") from exc


def load_sharded(directory: Path, program: StageProgram) -> None:
    """Load a DCP checkpoint into ``program``, resharded to however its model is held now.

    Works the same on a sharded stage of any number of ranks (a collective: all ranks call it)
    and in one process with no process group (the whole state is read into the plain model).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(program.model, program.optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    try:
        with warnings.catch_warnings():  # one plain process reading a sharded checkpoint is intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(directory), no_dist=not in_default_group())
    except Exception as exc:
        raise ShardingError(f"cannot read the sharded checkpoint {directory}: {exc}") from exc
    set_state_dict(
        program.model,
        program.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
    )


def holds_dtensors(model: nn.Module) -> bool:
    """Whether any of ``model``'s parameters is a DTensor (the model is sharded in this process).

    No DTensor exists before ``torch.distributed.tensor`` is imported, so a process that never
    sharded anything answers without importing it (see the imports above).
    """
    tensor_module = sys.modules.get("torch.distributed.tensor")
    if tensor_module is None:
        return False
    return any(isinstance(p, tensor_module.DTensor) for p in model.parameters())


def in_default_group() -> bool:
    """Whether this process is a rank of torch.distributed's default group (a sharded stage's rank)."""
    return dist.is_available() and dist.is_initialized()


__all__ = [
    "PARALLEL",
    "SHARDED",
    "ForwardRoot",
    "LossRoot",
    "RelayRoot",
    "ShardedCompute",
    "ShardedMiddle",
    "ShardedUpstream",
    "ShardingError",
    "backend_for",
    "full_parameters",
    "holds_dtensors",
    "in_default_group",
    "load_sharded",
    "parameter_bytes",
    "save_sharded",
    "shard_program",
    "stage_mesh",
    "to_device",
]
