"""A stage's stderr into the trainer's log: marked as the stage's, and at a bounded rate.

A stage is a tenant's code, and its output lands in the operator's log. So every line is marked
(logger ``stage``, the stage's own ``job_id`` and ``stage`` whatever it wrote; a JSON record keeps
its other fields, never the trainer's ``ts``, ``severity``, ``service``, ``logger``), cut at
``MAX_LOG_LINE``, and passed on within a byte budget: a token bucket of ``LOG_BURST_BYTES`` refilled
at ``LOG_BYTES_PER_S``. What does not fit is read and dropped (the stage never blocks on its pipe),
counted (``nebula_trainer_stage_log_dropped_lines``) and said: one warning with how many lines and
bytes were dropped, at most every ``DROPS_SAID_EVERY_S`` while the flood goes on and once at its end.
A stage therefore adds at most ``LOG_BURST_BYTES`` plus ``LOG_BYTES_PER_S`` x its running time to the
trainer's log, plus one short warning per ``DROPS_SAID_EVERY_S``, however much it writes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import IO

from prometheus_client import Counter

STAGE_LOG = logging.getLogger("stage")
"""What stage processes write (their records and any other output), marked with their job and stage."""
MAX_LOG_LINE = 16 << 10
TAIL_LINE_CHARS = 300
"""How much of each of a stage's last stderr lines its failure message may quote."""
"""Longest stage log line the trainer passes on (the rest is cut)."""
LOG_BYTES_PER_S = 4 << 10
"""Sustained rate of a stage's log the trainer passes on: about 20 lines of 200 bytes a second."""
LOG_BURST_BYTES = 256 << 10
"""What a stage may write at once beyond that rate (start-up output, a traceback)."""
DROPS_SAID_EVERY_S = 10.0
"""How often, at most, a flooding stage's dropped lines are said in the trainer's log."""
DROPPED_LINES = Counter(
    "nebula_trainer_stage_log_dropped_lines",
    "Stage log lines the trainer dropped because the stage wrote faster than its log budget.",
)
_TRAINERS_OWN = frozenset({"ts", "severity", "service", "logger", "message"})


class LogBudget:
    """A token bucket of bytes: ``take(n)`` is True while the stage's log may pass ``n`` more."""

    def __init__(
        self,
        rate: float = LOG_BYTES_PER_S,
        burst: float = LOG_BURST_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self._tokens = burst
        self._at = clock()

    def take(self, size: int) -> bool:
        now = self.clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if size > self._tokens:
            return False
        self._tokens -= size
        return True


def relay_log(
    stream: IO[bytes],
    job_id: str,
    stage: str,
    budget: LogBudget | None = None,
    tail: deque[str] | None = None,
) -> None:
    """Pass ``stream`` (the stage's stderr) into the trainer's log until it ends (see the module doc).

    ``tail`` keeps the last lines, budget or not: a stage that dies before it starts is reported with
    them (its own words: an import error, a crash of the interpreter), not with the trainer's EOF."""
    budget = budget or LogBudget()
    drops = _Drops(budget)
    for raw in stream:
        line = raw[:MAX_LOG_LINE].decode(errors="replace").rstrip("\n")
        if not line:
            continue
        if tail is not None:
            tail.append(line[:TAIL_LINE_CHARS])
        if not budget.take(len(line)):
            drops.add(len(line))
            continue
        drops.say(job_id, stage)
        _relay_line(line, job_id, stage)
    drops.say(job_id, stage, at_end=True)
    stream.close()


class _Drops:
    """Lines dropped since they were last said, and when that was."""

    def __init__(self, budget: LogBudget) -> None:
        self.budget = budget
        self.lines = self.size = 0
        self.said_at = budget.clock() - DROPS_SAID_EVERY_S

    def add(self, size: int) -> None:
        self.lines += 1
        self.size += size
        DROPPED_LINES.inc()

    def say(self, job_id: str, stage: str, *, at_end: bool = False) -> None:
        now = self.budget.clock()
        if not self.lines or (now - self.said_at < DROPS_SAID_EVERY_S and not at_end):
            return
        STAGE_LOG.warning(
            "stage log over its budget (%d bytes/s, bursts of %d): %d lines (%d bytes) dropped",
            self.budget.rate,
            self.budget.burst,
            self.lines,
            self.size,
            extra={
                "fields": {
                    "job_id": job_id,
                    "stage": stage,
                    "dropped_lines": self.lines,
                    "dropped_bytes": self.size,
                }
            },
        )
        self.lines = self.size = 0
        self.said_at = now


def _relay_line(line: str, job_id: str, stage: str) -> None:
    message, fields = line, {}
    level = logging.INFO
    with contextlib.suppress(ValueError):
        parsed = json.loads(line)
        if isinstance(parsed, dict):
            message = str(parsed.get("message", ""))
            fields = {k: v for k, v in parsed.items() if k not in _TRAINERS_OWN}
            if parsed.get("severity") in ("WARNING", "ERROR", "CRITICAL"):
                level = logging.getLevelName(parsed["severity"])
    fields.update(job_id=job_id, stage=stage)
    STAGE_LOG.log(level, message, extra={"fields": fields})


__all__ = [
    "LOG_BURST_BYTES",
    "LOG_BYTES_PER_S",
    "MAX_LOG_LINE",
    "STAGE_LOG",
    "TAIL_LINE_CHARS",
    "LogBudget",
    "relay_log",
]
