"""Draining the edges when the switch stops, so every edge's ``edge.close`` record is written.

A gRPC server's ``stop(grace)`` returns once the core cancelled the calls still open, before their
handlers ran their ``finally`` (where the ``edge.close`` record is written). So the servicer keeps the
task of every edge it serves (any transport), and the stopping switch waits for them after its servers
stopped and before its audit log closes; an edge that ends from the stop on is recorded as cut by it.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)

EDGE_DRAIN_S = 10.0
"""How long a stopping switch waits, after its servers stopped, for open edges to record their end."""


class EdgeDrain:
    """The edges being served and the switch's stop (see the module doc); part of ``RelayServicer``."""

    # The tasks serving an edge (any transport), so a stopping switch can wait for their records.
    _edges: set[asyncio.Task[object]]
    _stopping: bool

    def stopping(self) -> None:
        """The switch is stopping: an edge that ends from now on was cut by the stop (its record says so)."""
        self._stopping = True

    async def drain_edges(self, timeout: float = EDGE_DRAIN_S) -> None:
        """Wait until every edge has recorded its end; run after the servers stopped, before the audit closes.

        A gRPC server's ``stop(grace)`` returns once the core cancelled the calls still open, before their
        handlers ran their ``finally`` (the ``edge.close`` record). An edge still running after ``timeout``
        (it cannot be, short of a bug) is cancelled here and waited for as long again.
        """
        self._stopping = True
        pending = {task for task in self._edges if not task.done()}
        if not pending:
            return
        _, pending = await asyncio.wait(pending, timeout=timeout)
        if pending:
            log.warning("edges still open %.0f s after the stop: cancelling them", timeout)
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=timeout)
