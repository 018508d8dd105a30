"""What each data-parallel rank of a stage computes on its rows (``parallel`` moves the rows between ranks).

Three roles: a stage that owns the loss runs it through DDP (``ReplicaCompute``); an upstream stage runs
its rows forward and, once their gradient comes back, backward (``UpstreamCompute``); a middle stage of a
chain relays its received rows and returns their gradient (``MiddleCompute``). Upstream and middle
stages sum their parameter gradients at the step boundary (``sum_gradients``) rather than through DDP's
reducer, because under 1F1B earlier micro-batches' backwards still come after the last forward.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nebula_common.jobspec.runtime import StageProgram
from services.trainer.runtime.sharding import LossRoot

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64)
"""The dtypes rows may have between ranks (their index goes in ``parallel``'s command header)."""


def _no_forward_buffer_sync() -> dict[str, bool]:
    """DDP's keyword for "no buffer broadcast before each forward", in the installed torch's spelling.

    torch 2.13 deprecates ``broadcast_buffers`` (a FutureWarning in every data-parallel stage's log) for
    ``forward_sync_buffers``, which still broadcasts rank 0's buffers once at construction. Every replica
    already starts from the same state, so that one broadcast changes no value; older torch lacks it.
    """
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


class DataParallelError(RuntimeError):
    """A replica failed to start, or a collective failed (a replica died or timed out)."""


class ReplicaCompute:
    """One rank's share of a micro-batch: loss through DDP, gradient of the received rows (backprop)."""

    def __init__(
        self, program: StageProgram, group: dist.ProcessGroup, micro_batches: int, backprop: bool
    ) -> None:
        self.program = program
        self.micro_batches = micro_batches
        self.backprop = backprop
        sync = _no_forward_buffer_sync()
        self.ddp = DistributedDataParallel(LossRoot(program), process_group=group, **sync)

    def run(self, rows: torch.Tensor, ids: list[int], last: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        received = rows.requires_grad_(True) if self.backprop else rows
        # Accumulate locally; DDP all-reduces the accumulated gradients once, in the last backward.
        sync = contextlib.nullcontext() if last else self.ddp.no_sync()
        with sync:
            loss = self.ddp(received, self.program.batch(ids)) / self.micro_batches
            loss.backward()
        return loss.detach().reshape(1), received.grad if self.backprop else None


class UpstreamCompute:
    """A rank's share of an upstream micro-batch: output rows now, their backward once the gradient comes."""

    def __init__(self, program: StageProgram, group: dist.ProcessGroup) -> None:
        self.program = program
        self.group = group
        self._outputs: dict[int, torch.Tensor] = {}

    def forward(self, micro_batch: int, ids: list[int]) -> torch.Tensor:
        """Run this rank's rows and keep the graph until their gradient arrives; a detached copy to gather."""
        out = self.program.forward(self.program.batch(ids))
        if out.dtype not in DTYPES:
            raise DataParallelError(f"cannot gather dtype {out.dtype}")
        self._outputs[micro_batch] = out
        return out.detach().contiguous()

    def backward(self, micro_batch: int, grad: torch.Tensor) -> None:
        out = self._outputs.pop(micro_batch)
        if grad.shape != out.shape:
            raise DataParallelError(f"gradient rows {tuple(grad.shape)} != output rows {tuple(out.shape)}")
        out.backward(grad.to(out.dtype))

    def sum_gradients(self) -> None:
        sum_gradients(self.program, self.group)


class MiddleCompute:
    """A rank's share of a middle stage: its rows relayed now, their backward when the gradient comes."""

    def __init__(self, program: StageProgram, group: dist.ProcessGroup) -> None:
        self.program = program
        self.group = group
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, micro_batch: int, rows: torch.Tensor, ids: list[int]) -> torch.Tensor:
        """Relay this rank's received rows, keep the graph; a detached copy of the output rows to gather."""
        received = rows.requires_grad_(True)
        out = self.program.relay(received, ids)
        if out.dtype not in DTYPES:
            raise DataParallelError(f"cannot gather dtype {out.dtype}")
        self._pending[micro_batch] = (received, out)
        return out.detach().contiguous()

    def backward(self, micro_batch: int, grad: torch.Tensor) -> torch.Tensor:
        """Backpropagate the output rows' gradient; the gradient of this rank's received rows."""
        received, out = self._pending.pop(micro_batch)
        if grad.shape != out.shape:
            raise DataParallelError(f"gradient rows {tuple(grad.shape)} != output rows {tuple(out.shape)}")
        out.backward(grad.to(out.dtype))
        if received.grad is None:
            raise DataParallelError(
                "the middle stage's output does not depend on what it received: no gradient to send up"
            )
        return received.grad.contiguous()


def sum_gradients(program: StageProgram, group: dist.ProcessGroup) -> None:
    """Sum the ranks' parameter gradients (each rank holds its rows' share of the combined batch's).

    A parameter that got no gradient on any rank keeps ``None``, as in the
    unsplit run, so the optimizer skips it there too.
    """
    params = [p for p in program.model.parameters() if p.requires_grad]
    present = torch.tensor([0.0 if p.grad is None else 1.0 for p in params])
    group.allreduce([present]).wait()
    synced = [p for p, flag in zip(params, present.tolist(), strict=True) if flag > 0]
    for param in synced:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        elif param.grad.is_sparse:
            raise DataParallelError(
                "sparse gradients are not supported on a data-parallel stage that relays rows"
            )
    for dtype in sorted({p.grad.dtype for p in synced}, key=str):  # type: ignore[union-attr]
        grads = [p.grad for p in synced if p.grad is not None and p.grad.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in grads])
        group.allreduce([flat]).wait()
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
