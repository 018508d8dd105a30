"""The loss-owning last stage, one optimizer step at a time (backprop and one_way jobs alike).

backprop: each arriving activation becomes a loss, is backpropagated, and the activation's
gradient goes straight back. one_way: the received output (e.g. token ids) only feeds the loss;
nothing goes back but, after the optimizer step (the replicas sync first), a SYNC signal with
the step's loss that paces the generator (``one_way_steps``). Why a module of its own: the
downstream follows whatever order the upstream's schedule gives the edge, and posts its receives
a step ahead, which neither upstream role does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nebula_common.jobspec.runtime import ProgramError, StageProgram
from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer.edge import EdgeClosedError
from services.trainer.runtime.one_way_steps import SYNC
from services.trainer.runtime.parallel import DataParallelGroup
from services.trainer.runtime.program import micro_batch_ids
from services.trainer.runtime.rank_group import RankGroup
from services.trainer.runtime.schedule import downstream_ops
from services.trainer.runtime.transfer import AsyncSender, ReceiveAhead


class DownstreamSteps:
    """One attempt's steps of the last stage, which starts at step ``start``.

    ``finish(step)`` steps the optimizer (the stage's, or its replicas' together).
    """

    def __init__(
        self,
        spec: trainer_pb2.StageSpec,
        program: StageProgram,
        group: DataParallelGroup | RankGroup | None,
        receiver: ReceiveAhead,
        sender: AsyncSender,
        finish: Callable[[int], None],
        *,
        start: int,
    ) -> None:
        self.spec = spec
        self.program = program
        self.group = group
        self.receiver = receiver
        self.sender = sender
        self.finish = finish
        self.one_way = spec.program.mode == "one_way"
        self.int_payload = spec.program.payload == "int64"
        self.posted_through = start - 1

    def run(self, step: int) -> tuple[float | None, dict[str, object]]:
        """One step: every micro-batch's loss (and gradient back), the optimizer step, a one_way sync."""
        loss = self._losses(step)
        self.finish(step)  # replicas sync first ...
        if self.one_way:  # ... then the root syncs with the upstream stage
            self.sender.send_signal(SYNC, step, [loss])
        return loss, {}

    def _post_receives(self, through: int) -> None:
        """Post the activations of every step up to ``through`` (within the job) not yet posted.

        The downstream posts one step ahead, so the next step's first activation is decoded
        while this step's last micro-batch and optimizer step compute.
        """
        cfg = self.spec.program
        for step in range(self.posted_through + 1, min(through, self.spec.steps - 1) + 1):
            for op in downstream_ops(cfg.micro_batches):
                if op.kind == "F":
                    self.receiver.expect_tensor(
                        step, op.micro_batch, micro_batch_ids(cfg, step, op.micro_batch)
                    )
            self.posted_through = step

    def _losses(self, step: int) -> float:
        cfg, program, group = self.spec.program, self.program, self.group
        backprop = not self.one_way
        total = 0.0
        self._post_receives(step + 1)
        for op in downstream_ops(cfg.micro_batches):
            if op.kind != "F":
                continue  # each micro-batch's backward is sent right after its forward, below
            ids = micro_batch_ids(cfg, step, op.micro_batch)
            received = self.receiver.tensor(step, op.micro_batch)
            if self.int_payload and received.dtype != torch.int64:
                raise EdgeClosedError(f"the edge payload is int64 but the peer sent {received.dtype}")
            if group is not None:
                value, grad = group.micro_batch(step, op.micro_batch, received, ids)
            else:
                memory = received.requires_grad_(True) if backprop else received
                loss = program.loss(memory, program.batch(ids)) / cfg.micro_batches
                loss.backward()
                value, grad = loss.item(), memory.grad
            if backprop:
                if grad is None:
                    raise ProgramError("loss() does not depend on the received tensor: no gradient to return")
                self.sender.send(grad, step, op.micro_batch, ids)
            total += value
        return total


__all__ = ["DownstreamSteps"]
