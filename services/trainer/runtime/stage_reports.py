"""What a running stage reports per step and at its end: its status board (watchers) and its step sink.

Why a module of its own: every role reports the same numbers the same way (a chain's middle sums
its two edges), and what watchers and Prometheus see must not depend on which loop ran the step.
"""

from __future__ import annotations

from collections.abc import Callable

from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer.edge import EdgeConnection, EdgeStats
from services.trainer.runtime.chain import combined_stats, edge_traffic
from services.trainer.status import StatusBoard

StepSink = Callable[[str, str, float, float, float | None], None]
"""Where each step's numbers go besides the board: (job_id, stage, step s, wait s, loss or None)."""


def report_running(board: StatusBoard, start: int, epoch: int) -> None:
    """An attempt's first status: RUNNING from step ``start``; in a later epoch, recovered and from where."""
    status: dict[str, object] = dict(state=trainer_pb2.STAGE_STATE_RUNNING, steps_done=start, epoch=epoch)
    if epoch > 0:
        message = f"recovered: epoch {epoch} resumed from step {start}"
        status.update(resumed_from_step=start, message=message)
    board.update(**status)


def report_step(
    board: StatusBoard,
    sink: StepSink,
    spec: trainer_pb2.StageSpec,
    step: int,
    elapsed: float,
    waited: float,
    loss: float | None,
    stats: EdgeStats,
    **extra: object,
) -> None:
    """One step's numbers to the status board (what watchers see) and to the sink (Prometheus)."""
    sink(spec.job_id, spec.stage, elapsed, waited, loss)
    fields: dict[str, object] = dict(
        steps_done=step + 1,
        step_seconds=elapsed,
        wait_seconds=waited,
        bytes_sent=stats.bytes_sent,
        bytes_received=stats.bytes_received,
        raw_bytes_sent=stats.raw_bytes_sent,
        raw_bytes_received=stats.raw_bytes_received,
        **extra,
    )
    if loss is not None:
        fields["loss"] = loss
    board.update(**fields)


def report_traffic(board: StatusBoard, edges: list[EdgeConnection]) -> None:
    """The edges' final counters, per edge and summed (after the last step's sends were flushed)."""
    stats = combined_stats(edges)
    board.update(
        bytes_sent=stats.bytes_sent,
        bytes_received=stats.bytes_received,
        raw_bytes_sent=stats.raw_bytes_sent,
        raw_bytes_received=stats.raw_bytes_received,
        edges=edge_traffic(edges),
    )


__all__ = ["StepSink", "report_running", "report_step", "report_traffic"]
