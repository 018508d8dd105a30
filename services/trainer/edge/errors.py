"""How an edge ends: the exceptions a stage sees, so it can tell a void attempt from a lost one.

A stage reacts differently to each: ``EdgeRestartRequired`` reopens in the peer's epoch,
``EdgeOutage`` restarts from the last common checkpoint, any other ``EdgeClosedError`` fails the
stage. ``ProtocolError`` never leaves the session: a peer that broke the delivery contract fails
the edge with its message.
"""

from __future__ import annotations


class EdgeClosedError(RuntimeError):
    """The edge ended (peer finished, failed, the link stayed down too long) while we expected an item."""


class EdgeTimeout(EdgeClosedError):
    """Nothing arrived within the receive's timeout (of link-up time); the edge itself is still open."""


class EdgeRestartRequired(EdgeClosedError):
    """The other side moved to a higher epoch: this attempt is void, reopen with ``epoch`` (or higher)."""

    def __init__(self, epoch: int, reason: str) -> None:
        super().__init__(reason)
        self.epoch = epoch
        self.reason = reason


class EdgeOutage(EdgeClosedError):
    """The link (or the stream to the switch) stayed down past ``max_outage_s``: this attempt is lost."""


def renewed(error: EdgeClosedError) -> EdgeClosedError:
    """A fresh exception of the same kind and content (to re-raise on another thread or call)."""
    if isinstance(error, EdgeRestartRequired):
        return EdgeRestartRequired(error.epoch, error.reason)
    if isinstance(error, EdgeOutage):
        return EdgeOutage(str(error))
    return EdgeClosedError(str(error))


class ProtocolError(Exception):
    """The peer broke the delivery contract; the edge fails with this message."""


__all__ = [
    "EdgeClosedError",
    "EdgeOutage",
    "EdgeRestartRequired",
    "EdgeTimeout",
    "ProtocolError",
    "renewed",
]
