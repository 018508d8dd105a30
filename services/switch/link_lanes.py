"""The link's lanes at work: further connections joining a session, retiring, and how many to keep.

The lane protocol (marks, in-order delivery) is ``lanes.py``, how many lanes ``lane_tuner.py``; this module
runs them on a :class:`~services.switch.link.PeerLink`. Both roles run a joined connection the same way
(:meth:`LinkLanes.run_lane`): a lane that fails ends the whole session, since what it carried may be
lost, a gap no other lane can fill; a retired lane ends alone once both last marks crossed. Only the
dialer opens lanes, and keeps their count at its target (:meth:`LinkLanes._manage_lanes`): a fixed
count, or the tuner's, from the link's throughput over busy intervals (``PeerLink.link_busy``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from nebula_common.cancellation import raise_if_cancelling
from services.switch.express import EXPRESS_LANE
from services.switch.lane_tuner import MAX_LANES, LaneTuner, busy_interval
from services.switch.link_handshake import HandshakeError
from services.switch.link_pumps import LinkPumps
from services.switch.link_transport import Closeable, LaneOpenFn, ReadFn, WriteFn
from services.switch.metrics import LINK_CONNECTIONS

log = logging.getLogger(__name__)

LANE_SAMPLE_S = 0.1
LANE_INTERVAL_S = 2.0
"""The lane tuner's measurement interval (busy is sampled every LANE_SAMPLE_S within it)."""


class LinkLanes(LinkPumps):
    """The lanes of a link's sessions (see the module doc); the pumps carry each lane's items."""

    #: Connections the dialer keeps per session: a fixed count, or None to self-tune (lanes.py).
    connections: int | None
    _lane_channels: dict[int, tuple[Closeable, asyncio.Task[None]]]
    _express_channel: tuple[Closeable, asyncio.Task[None]] | None = None

    _lanes_changed: asyncio.Event

    def joins_current_session(self, session_id: bytes) -> bool:
        """True if a further connection with ``session_id`` may join the running session as a lane."""
        lanes = self._lanes
        return lanes is not None and lanes.marking and bool(session_id) and lanes.session_id == session_id

    def session_started(self) -> None:
        """The running session changed (``run_session``): wake connections waiting to join it."""
        changed, self._lanes_changed = self._lanes_changed, asyncio.Event()
        changed.set()

    async def await_session(self, session_id: bytes, timeout_s: float) -> bool:
        """Whether a further connection with ``session_id`` may join the running session, waiting up to
        ``timeout_s`` for that session to start: the dialer opens its connections right after our reply
        to the first, which may reach us while the session before still winds down."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self.joins_current_session(session_id):
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._lanes_changed.wait(), remaining)
            except TimeoutError:
                return False
        return True

    async def run_lane(self, lane: int, read: ReadFn, write: WriteFn, session_id: bytes = b"") -> None:
        """Carry the current session's items over one more connection until it is retired or lost.

        A lane that fails (read or write error, EOF without a retiring mark) ends the whole session:
        items written to it may be lost, a gap no other lane can fill (lanes.py). A lane that is
        retired (``retire_lane``, or the peer's last mark) ends alone once both last marks crossed.
        """
        lanes = self._lanes
        if lanes is None or not lanes.marking or (session_id and lanes.session_id != session_id):
            raise HandshakeError(f"lane {lane} has no session to join")
        express = lanes.express if lane == EXPRESS_LANE else None
        if lane == EXPRESS_LANE:
            if express is None or express.up:
                raise HandshakeError("the session has no express connection to open, or runs one already")
            express.up = True
        else:
            lanes.striped = True  # marks on every item from now on (SessionLanes)
            lanes.active.add(lane)
            LINK_CONNECTIONS.labels(self.expected_peer.cluster_id).set(len(lanes.active))
        writer = asyncio.create_task(self._pump_out(write, lane), name=f"link-writer-{lane}")
        reader = asyncio.create_task(self._pump_in(read, lane), name=f"link-reader-{lane}")
        ended = asyncio.create_task(lanes.failed.wait(), name=f"link-lane-{lane}-session")
        try:
            pending: set[asyncio.Task[object]] = {writer, reader}  # type: ignore[arg-type]
            while pending:
                done, pending = await asyncio.wait({*pending, ended}, return_when=asyncio.FIRST_COMPLETED)
                if ended in done:
                    return
                pending.discard(ended)
                for task in done:
                    error = task.exception()
                    if error is not None:
                        lanes.fail(f"connection {lane} of the link failed: {error}")
                        return
        except asyncio.CancelledError:
            # The call was cancelled under us (the peer dropped this connection): unless the lane was
            # being retired, what it carried may be lost, so the session must end.
            if lane not in lanes.retiring:
                lanes.fail(f"connection {lane} of the link was cancelled")
            raise
        finally:
            for task in (writer, reader, ended):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if express is not None:
                express.up = False  # sparse items go on the other connections again
                self.router.outbound_wake.set()
            lanes.active.discard(lane)
            lanes.retiring.discard(lane)
            if self._lanes is lanes:
                LINK_CONNECTIONS.labels(self.expected_peer.cluster_id).set(len(lanes.active))

    async def _open_express(self, open_lane: LaneOpenFn, session_id: bytes) -> None:
        """Open the session's express connection (``express.py``) if both ends announced it and it is
        not open; a failure is logged and tried again next interval (small items then go on the others)."""
        session = self._lanes
        if session is None or session.express is None or self._express_channel is not None:
            return
        if session.session_id != session_id:
            return  # the session before this one still winds down
        try:
            self._express_channel = await open_lane(EXPRESS_LANE)
        except (grpc.aio.AioRpcError, HandshakeError, TimeoutError, OSError) as exc:
            log.warning("cannot open the link's express connection: %s (retry later)", exc)

    def _carried(self) -> tuple[object, int]:
        """Bytes the link carried both ways so far, and the session's pacer they count in.

        On a paced session: what the peer acknowledged reading of ours and what we read of its, byte by
        byte. The link's item counters count an item whole as its first fragment leaves: with 1 MiB
        tensors over a 2 s interval a path carrying 0.5 to 1.5 MB/s measured in steps of half a MB/s,
        so the tuner judged a doubling on which interval a tensor happened to start in, far above its
        5% gain."""
        pacer = self._pacer
        if pacer is None:
            return None, self.sent.bytes + self.received.bytes
        return pacer, pacer.acked + self._rx_bytes

    def lane_counts(self) -> dict[int, int]:
        """Items written per connection in the current session ({} without lanes)."""
        lanes = self._lanes
        return dict(lanes.written) if lanes is not None else {}

    async def drop_connection(self, lane: int) -> bool:
        """Fault control: close one extra connection abruptly (no retiring). The session ends, the
        link reconnects and the trainers replay (lanes.py). False if this switch has no such lane."""
        entry = self._express_channel if lane == EXPRESS_LANE else self._lane_channels.get(lane)
        if entry is None:
            return False
        await entry[0].close()
        return True

    def retire_lane(self, lane: int) -> None:
        """Stop sending on ``lane``: its writer sends a last mark, the peer answers with its own."""
        lanes = self._lanes
        if lanes is not None and lane in lanes.active and lane != 0:
            lanes.retiring.add(lane)
            self.router.outbound_wake.set()

    async def _manage_lanes(self, open_lane: LaneOpenFn, session_id: bytes = b"") -> None:
        """Keep the session's connection count at its target: fixed, or self-tuned (lanes.py)."""
        tuner = LaneTuner() if self.connections is None else None
        target = self.connections or 1
        lanes: dict[int, tuple[Closeable, asyncio.Task[None]]] = {}
        self._lane_channels = lanes
        try:
            while True:
                await self._open_express(open_lane, session_id)
                # A session that ends while a connection opens cancels us inside the handshake's
                # wait_for, which on Python 3.11 may swallow the cancel when the reply arrives at once:
                # without this the session's end would wait on us forever.
                raise_if_cancelling()
                for index, (channel, task) in list(lanes.items()):
                    if task.done():
                        del lanes[index]
                        await channel.close()
                missing = target - len(lanes) - 1
                if missing > 0:  # dialled together: a doubling waits one handshake, not one each
                    free = [i for i in range(1, MAX_LANES) if i not in lanes][:missing]
                    opened = await asyncio.gather(*(open_lane(i) for i in free), return_exceptions=True)
                    raise_if_cancelling()
                    for index, lane in zip(free, opened, strict=True):
                        if isinstance(lane, grpc.aio.AioRpcError | HandshakeError | TimeoutError | OSError):
                            log.warning("cannot open link connection %d: %s (retry later)", index, lane)
                        elif isinstance(lane, BaseException):
                            raise lane
                        else:
                            lanes[index] = lane
                for index in sorted(lanes, reverse=True)[: max(0, len(lanes) + 1 - target)]:
                    self.retire_lane(index)
                session, carried = self._carried()
                busy, samples = 0, 0
                started = time.monotonic()
                while time.monotonic() - started < LANE_INTERVAL_S:
                    await asyncio.sleep(LANE_SAMPLE_S)
                    samples += 1
                    busy += self.link_busy()
                if tuner is not None:
                    now_session, now_carried = self._carried()
                    rate = (now_carried - carried) / (time.monotonic() - started)
                    target = tuner.observe(rate, busy_interval(busy, samples) and now_session is session)
                elif self.connections is not None:
                    target = self.connections  # a changed fixed count applies from the next interval
        finally:
            express, self._express_channel = self._express_channel, None
            for channel, task in [*lanes.values(), *([express] if express is not None else [])]:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                await channel.close()
