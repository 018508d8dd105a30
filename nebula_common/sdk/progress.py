"""A job's live progress: one bar with step, loss, step time and WAN throughput, fed by stage statuses.

One implementation for every place a person watches a job (``nebula job submit``, ``nebula job
watch``, ``Job.wait(progress=True)`` in the SDK), so they show the same numbers the same way.
The throughput is what both stages' edges sent (encoded bytes, from their statuses) over the
last few seconds: the WAN as this job uses it, not the link's total.
"""

from __future__ import annotations

import time
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from nebula_common.cli.console import new_console
from nebula_common.proto.nebula.v1 import trainer_pb2

NOTED_STATES = (trainer_pb2.STAGE_STATE_RECOVERING, trainer_pb2.STAGE_STATE_FAILED)


class Throughput:
    """WAN throughput of one job (both directions, Mbit/s) over a sliding window of status updates."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self._sent: dict[str, int] = {}
        self._samples: list[tuple[float, int]] = []

    def add(self, status: trainer_pb2.StageStatus, now: float | None = None) -> float:
        """Take a stage's status (its cumulative bytes sent); the rate over the window so far."""
        now = time.monotonic() if now is None else now
        self._sent[status.stage] = status.bytes_sent
        total = sum(self._sent.values())
        self._samples.append((now, total))
        while len(self._samples) > 2 and now - self._samples[0][0] > self.window_s:
            del self._samples[0]
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        return (b1 - b0) * 8 / 1e6 / (t1 - t0) if t1 > t0 and b1 >= b0 else 0.0


class ProgressBar:
    """The bar (a context manager); ``update`` with every status of every stage of the job."""

    def __init__(
        self,
        title: str,
        total: int,
        completed: int = 0,
        console: Console | None = None,
        disable: bool = False,
    ) -> None:
        columns = (
            TextColumn(f"[bold]{title}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("step {task.fields[step_ms]} ms"),
            TextColumn("WAN {task.fields[mbit]} Mbit/s"),
            TimeElapsedColumn(),
        )
        self._progress = Progress(*columns, console=console or new_console(stderr=True), disable=disable)
        self._task = self._progress.add_task(
            title, total=total, completed=completed, loss="-", step_ms="-", mbit="-"
        )
        self._rate = Throughput()
        self._noted: set[tuple[str, int, int]] = set()
        self.mbit = 0.0

    def __enter__(self) -> ProgressBar:
        self._progress.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._progress.stop()

    def note(self, text: str) -> None:
        """A line above the bar (it stays when the bar moves on)."""
        self._progress.console.print(text)

    def update(self, status: trainer_pb2.StageStatus) -> None:
        """One status of one stage: the bar follows the loss-owning stage; trouble is noted once."""
        self.mbit = self._rate.add(status)
        key = (status.stage, status.state, status.epoch)
        if status.state in NOTED_STATES and key not in self._noted:
            self._noted.add(key)
            state = trainer_pb2.StageState.Name(status.state).removeprefix("STAGE_STATE_")
            epoch = f" (epoch {status.epoch})" if status.epoch else ""
            self.note(f"[yellow]{status.stage}: {state}{epoch}: {status.message}[/]")
        if status.HasField("loss"):
            self._progress.update(
                self._task,
                completed=status.steps_done,
                loss=f"{status.loss:.4f}",
                step_ms=f"{status.step_seconds * 1000:.0f}",
                mbit=f"{self.mbit:.1f}",
            )


__all__ = ["ProgressBar", "Throughput"]
