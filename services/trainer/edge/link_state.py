"""Whether an edge is up, how long it has been down, and how it ended (the session's liveness).

Outages pause: while the link (or the stream to the switch) is down nothing is sent, and waits do
not count the outage against their timeouts; an outage longer than ``max_outage_s`` ends the edge
with ``EdgeOutage`` (the stage then restarts from the last common checkpoint in a new epoch; no
close is sent, the peer learns of the new epoch from its switch). In a session of epoch > 0 the
outage limit only runs once the link has been up (the stage waits for the link without a deadline
before it exchanges RESUME signals).

``EdgeLinkState`` is one part of ``EdgeSession`` (``session``): it keeps this state under the
session's condition and runs the session's timer thread, which also drives the retransmit check
(``replay``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from services.trainer.edge.errors import EdgeClosedError, EdgeOutage, renewed
from services.trainer.edge.settings import EdgeSettings

log = logging.getLogger(__name__)


class EdgeLinkState:
    """Link up/down, outage time, the peer's close and the edge's failure (part of ``EdgeSession``)."""

    # Provided by the other parts of EdgeSession (annotations only: nothing here shadows them).
    name: str
    epoch: int
    settings: EdgeSettings
    _clock: Callable[[], float]
    _cond: threading.Condition
    _on_link_up_locked: Callable[[], None]  # what a fresh link sets off in both halves (session)
    _check_retransmit_locked: Callable[[float], None]  # the sender's timeout rewind (replay)
    fail: Callable[..., None]  # end the edge now (session)

    def _init_link_state(self) -> None:
        self._ever_ready = False
        self._ever_up = False
        self._link_up = False
        self._down_since: float | None = None
        self._outage_total = 0.0
        self._failed: str | None = None
        self._error: EdgeClosedError | None = None  # what waits raise once failed (kind + reason)
        self._last_down_reason = ""
        self._peer_closed: str | None = None
        self._peer_error = False  # the peer's close said it failed

    @property
    def link_up(self) -> bool:
        return self._link_up

    def outage_seconds(self) -> float:
        """Total time the link has been down since the session started (including a current outage)."""
        with self._cond:
            return self._outage_locked()

    def _outage_locked(self) -> float:
        current = self._clock() - self._down_since if self._down_since is not None else 0.0
        return self._outage_total + current

    def _set_down_locked(self, reason: str) -> None:
        self._last_down_reason = reason
        if self._link_up or self._down_since is None:
            if self._down_since is None:
                self._down_since = self._clock()
            if self._link_up:
                log.warning("edge link down", extra={"fields": {"edge": self.name, "reason": reason}})
        self._link_up = False
        self._cond.notify_all()

    def _set_up_locked(self) -> None:
        if self._down_since is not None:
            self._outage_total += self._clock() - self._down_since
            self._down_since = None
        self._link_up = True
        self._ever_up = True
        self._on_link_up_locked()
        self._cond.notify_all()

    def _fail_locked(self, reason: str, error: EdgeClosedError | None = None) -> None:
        if self._failed is None:
            self._failed = reason
            self._error = error or EdgeClosedError(reason)
            log.warning("edge failed", extra={"fields": {"edge": self.name, "reason": reason}})
        self._cond.notify_all()

    def _error_locked(self) -> EdgeClosedError:
        if self._error is not None:
            return renewed(self._error)
        return EdgeClosedError(self._failed or self._peer_closed or "edge closed")

    @property
    def failure(self) -> EdgeClosedError | None:
        """How the edge ended (None while it has not): an ``EdgeRestartRequired`` or ``EdgeOutage``
        here after ``close`` means the attempt was lost while closing."""
        with self._cond:
            return self._error

    @property
    def peer_failure(self) -> str | None:
        """The peer's reason when it closed the edge because it failed (None otherwise): a middle
        stage of a chain passes it on to its other edge at once (``runtime.chain``)."""
        with self._cond:
            return self._peer_closed if self._peer_error else None

    def wait_link_up(self) -> None:
        """Block until the link is up, without a deadline; raises if the edge ends first (a cancel
        aborts the edge, so this is cancellable)."""
        with self._cond:
            while not self._link_up:
                self._raise_if_ended_locked()
                self._cond.wait(0.25)
            self._raise_if_ended_locked()

    def _terminal_reason_locked(self) -> str | None:
        return self._failed or self._peer_closed

    def _raise_if_ended_locked(self) -> None:
        if self._failed is not None:
            raise self._error_locked()
        if self._peer_closed is not None:
            raise EdgeClosedError(self._peer_closed)

    def _tick(self) -> None:
        """The session's timer thread: the outage limit, and the retransmit check every 50 ms."""
        while True:
            with self._cond:
                if self._failed is not None:
                    return
                now = self._clock()
                limit = self.settings.max_outage_s
                # A new epoch's session waits for the link without a deadline until it was up once.
                armed = self._ever_ready and (self.epoch == 0 or self._ever_up)
                if self._down_since is not None and now - self._down_since > limit and armed:
                    reason = (
                        f"WAN link to the peer cluster down for {now - self._down_since:.0f} s "
                        f"(limit {limit:g} s)"
                    )
                    failed = True
                else:
                    failed = False
                    self._check_retransmit_locked(now)
                    self._cond.wait(0.05)
            if failed:
                # No close: the peer cannot be reached now, and it learns of our next epoch from its
                # switch once the link is back (a close of this epoch would be void by then anyway).
                self.fail(reason, tell_peer=False, error=EdgeOutage(reason))
                return


__all__ = ["EdgeLinkState"]
