"""The generator side of a one_way job (ELECTRA, the paper's Scenario I), one optimizer step at a time.

The upstream stage (generator) trains on its own loss and sends only what it produced (e.g.
corrupted token ids, which travel exactly as int64); no gradient crosses. After each optimizer
step the downstream stage (the root discriminator, whose data-parallel replicas have synced
first) returns a SYNC signal for the step, values ``[loss]`` (``downstream_steps``); the upstream
stage may run at most ``sync_lag`` steps ahead of the last sync it received, so both sides stay
on the same pace while the generator's next step overlaps the discriminator's. Why a module of its
own: nothing of this role's step (produce, own loss, the sync pace, the payload's dtype) is shared
with a backprop upstream.
"""

from __future__ import annotations

import torch

from nebula_common.jobspec.runtime import ProgramError, StageProgram
from nebula_common.proto.nebula.v1 import relay_pb2, trainer_pb2
from services.trainer.edge import EdgeClosedError
from services.trainer.runtime.program import micro_batch_ids
from services.trainer.runtime.transfer import AsyncSender, ReceiveAhead

SYNC = relay_pb2.SIGNAL_KIND_SYNC


def checked_payload(cfg: trainer_pb2.ProgramStage, out: torch.Tensor) -> torch.Tensor:
    """What produce() returns must be the dtype the edge payload declares (int64 travels exactly)."""
    if cfg.payload != "int64":
        if not out.is_floating_point():
            raise ProgramError(
                f"produce() returned {out.dtype} but the edge payload is float (edges.0.payload: int64?)"
            )
        return out
    if out.dtype != torch.int64:
        raise ProgramError(f"the edge payload is int64 but produce() returned {out.dtype}")
    return out


class OneWayUpstreamSteps:
    """One attempt's steps of a generator stage that starts at step ``start`` (see the module doc)."""

    def __init__(
        self,
        spec: trainer_pb2.StageSpec,
        program: StageProgram,
        receiver: ReceiveAhead,
        sender: AsyncSender,
        *,
        start: int,
    ) -> None:
        self.spec = spec
        self.program = program
        self.receiver = receiver
        self.sender = sender
        self.start = start

    def run(self, step: int) -> tuple[float | None, dict[str, object]]:
        """One step: produce and train on the own loss (reported as ``local_loss``), then keep the pace."""
        local_loss = self._produce(step)
        self.program.finish_step()
        self._await_syncs(step)
        return None, {"local_loss": local_loss}

    def _produce(self, step: int) -> float:
        """Produce, send at once (the WAN overlaps the backward), train on the own loss."""
        cfg, program = self.spec.program, self.program
        micro_batches = cfg.micro_batches
        total = 0.0
        for micro_batch in range(micro_batches):
            ids = micro_batch_ids(cfg, step, micro_batch)
            out, own = program.produce(program.batch(ids))
            self.sender.send(checked_payload(cfg, out), step, micro_batch, ids)
            own = own / micro_batches
            own.backward()
            total += own.item()
        return total

    def _await_syncs(self, step: int) -> None:
        """After ``step``: wait for the sync of ``step - sync_lag``; after the last step, for all left."""
        lag = self.spec.program.sync_lag
        last = self.spec.steps - 1
        due = range(step - lag, last + 1) if step == last else range(step - lag, step - lag + 1)
        for synced in due:
            if synced < self.start:
                continue
            self.receiver.expect_signal(SYNC, synced)
            values = self.receiver.signal(SYNC, synced)
            if len(values) != 1:
                raise EdgeClosedError(f"sync mismatch: step {synced} sync carries {values}, expected [loss]")


__all__ = ["SYNC", "OneWayUpstreamSteps", "checked_payload"]
