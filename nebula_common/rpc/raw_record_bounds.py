"""How big a raw record may be and how many messages a ``RawConnection`` holds back, on either side.

Both sides of a connection (the event loop's, ``raw_records.py``, and its I/O thread's,
``raw_io_thread.py``) agree on these numbers, so they live apart from both.
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 64 << 20
"""Largest record accepted (the gRPC link's message limit)."""
READ_AHEAD = 8
"""Messages the I/O thread may receive ahead of the session (then it stops reading: TCP pushes back)."""
WRITE_AHEAD = 2
"""Messages a writer may queue for the I/O thread before it waits for the oldest to be sent."""
SMALL_MESSAGE = 64 << 10
"""Messages up to this size are joined with their header (one TLS record); bigger ones are not copied."""


class RecordViolation(ConnectionError):
    """The peer broke the record bounds (a record over the limit, a record stalled midway): not a cut."""


END = object()
"""What the I/O thread hands the loop after a clean end (a reader then returns ``grpc.aio.EOF``)."""

__all__ = ["END", "MAX_MESSAGE_BYTES", "READ_AHEAD", "SMALL_MESSAGE", "WRITE_AHEAD", "RecordViolation"]
