"""Which step loop an attempt runs, by the stage's role: what the runner's step loop calls each step.

Why a module of its own: the runner's loop (time, checkpoint, report) is the same for every role;
only this choice differs, and each role's loop lives in a module of its own (``upstream_steps``,
``one_way_steps``, ``downstream_steps``, and ``chain.MiddleStep`` for a chain's middle).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from nebula_common.jobspec.runtime import StageProgram
from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer.runtime.chain import LocalMiddle, MiddleStep
from services.trainer.runtime.downstream_steps import DownstreamSteps
from services.trainer.runtime.one_way_steps import OneWayUpstreamSteps
from services.trainer.runtime.parallel import DataParallelGroup
from services.trainer.runtime.rank_group import RankGroup
from services.trainer.runtime.transfer import AsyncSender, ReceiveAhead
from services.trainer.runtime.upstream_steps import UpstreamSteps


class RoleSteps(Protocol):
    """One attempt's steps of one role: ``run(step)`` trains one step, optimizer step included, and
    returns its loss (the loss-owning stage's; else None) and the role's own status fields."""

    def run(self, step: int) -> tuple[float | None, dict[str, object]]: ...


def role_steps(
    spec: trainer_pb2.StageSpec,
    program: StageProgram,
    group: DataParallelGroup | RankGroup | None,
    start: int,
    *,
    receiver: ReceiveAhead,
    sender: AsyncSender,
    below: tuple[ReceiveAhead, AsyncSender] | None,
    windows: list[int],
    window_inputs: list[tuple[float, float]],
) -> RoleSteps:
    """The steps of the attempt that starts at step ``start``; ``group``: the replicas or ranks that
    compute with the stage thread (None: the thread alone). ``receiver`` and ``sender`` are the
    stage's edge (a middle's upstream one; ``below``: its downstream one). ``windows`` and
    ``window_inputs``: where a 1F1B upstream records its windows (see ``UpstreamSteps``)."""
    cfg = spec.program
    finish: Callable[[int], None] = (
        group.finish_step if group is not None else lambda step: program.finish_step()
    )
    if below is not None:
        from_below, to_below = below
        # On n ranks (replicas, or rank processes) each rank relays its rows of every micro-batch.
        compute = group if group is not None else LocalMiddle(program)
        return MiddleStep(
            compute,
            cfg,
            finish,
            from_above=receiver,
            to_above=sender,
            from_below=from_below,
            to_below=to_below,
        )
    if cfg.role == "upstream" and cfg.mode == "one_way":
        return OneWayUpstreamSteps(spec, program, receiver, sender, start=start)
    if cfg.role == "upstream":
        windows_of = {"windows": windows, "window_inputs": window_inputs}
        return UpstreamSteps(spec, program, group, receiver, sender, finish, **windows_of)
    return DownstreamSteps(spec, program, group, receiver, sender, finish, start=start)


__all__ = ["RoleSteps", "role_steps"]
