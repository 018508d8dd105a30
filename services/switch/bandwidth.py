"""Bandwidth toward a peer switch, measured on demand with a train of padded Pings.

Why: ``codec: auto`` picks codecs for the link each edge crosses; a submitter's stated bandwidth may
be wrong or stale, so the SDK asks the sending cluster's switch to measure the link toward the
receiving cluster (``GetLinkStatusRequest.measure_bandwidth``) and falls back to the stated link
only when no measurement can be had.

How (packet-train dispersion): ``TRAIN`` Pings carrying ``size`` bytes of padding each are queued
back to back ahead of any item; the peer answers each with a small Pong at once (link_pumps.py), so the
Pongs come back spaced as the Pings left the slowest hop. Only the second half of the train is
timed (the first half may pass at line rate while a shaper's token bucket drains its burst, which
would overstate the rate): the seconds per Ping are the least-squares slope of the Pongs' arrival
times over their index there (a line through all of them, not two endpoints, so one Pong that a
busy event loop read late does not compress the train), and rate = bits per Ping / slope.
A train that passes in under ``MIN_SECONDS`` is too short to time on a busy host; the padding is
quadrupled and the train sent again, up to ``MAX_BYTES`` in one train. Probe Pings use nonces with
``PROBE_BIT`` set, so they never count as keepalive RTT samples. The measurement is on demand only
(never in the background), so it takes no bandwidth from jobs unless someone asks, and a result
younger than ``FRESH_S`` is returned as is.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from nebula_common.proto.nebula.v1 import link_pb2

PROBE_BIT = 1 << 62
TRAIN = 16
FIRST_BYTES = 4 * 1024
MAX_BYTES = 8 * 1024 * 1024
MIN_SECONDS = 0.25
FRESH_S = 60.0


class BandwidthProbeError(RuntimeError):
    """The link went down, or the Pongs did not come back in time."""


@dataclass(frozen=True)
class Measurement:
    bits_per_second: float
    at: float  # time.monotonic() when it was taken
    train_bytes: int


class BandwidthMeter:
    """One link's on-demand bandwidth probe (see the module doc); runs on the switch's event loop."""

    def __init__(self, queue: Callable[[link_pb2.LinkMessage], None]) -> None:
        self._queue = queue
        self._nonce = 0
        self._arrivals: dict[int, float] = {}
        self._waiting: set[int] = set()
        self._all_back = asyncio.Event()
        self._lock = asyncio.Lock()
        self.last: Measurement | None = None

    @staticmethod
    def is_probe(nonce: int) -> bool:
        return bool(nonce & PROBE_BIT)

    def on_pong(self, nonce: int) -> None:
        """A probe Pong arrived (the link's reader calls this for nonces with ``PROBE_BIT``)."""
        if nonce in self._waiting:
            self._arrivals[nonce] = time.monotonic()
            self._waiting.discard(nonce)
            if not self._waiting:
                self._all_back.set()

    def fresh(self) -> Measurement | None:
        last = self.last
        return last if last is not None and time.monotonic() - last.at < FRESH_S else None

    async def measure(self, timeout: float) -> Measurement:
        """Measure now (or return a fresh result); ``timeout`` bounds the whole measurement."""
        deadline = time.monotonic() + timeout
        async with self._lock:
            fresh = self.fresh()
            if fresh is not None:
                return fresh
            size = FIRST_BYTES
            while True:
                rate, seconds = await self._train(size, deadline)
                if seconds >= MIN_SECONDS or size * TRAIN * 4 > MAX_BYTES:
                    self.last = Measurement(rate, time.monotonic(), size * TRAIN)
                    return self.last
                size *= 4

    async def _train(self, size: int, deadline: float) -> tuple[float, float]:
        padding = b"\0" * size
        nonces = []
        self._arrivals.clear()
        self._all_back.clear()
        for _ in range(TRAIN):
            self._nonce += 1
            nonces.append(PROBE_BIT | self._nonce)
        self._waiting = set(nonces)
        for nonce in nonces:
            self._queue(link_pb2.LinkMessage(ping=link_pb2.Ping(nonce=nonce, padding=padding)))
        try:
            await asyncio.wait_for(self._all_back.wait(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            back = TRAIN - len(self._waiting)
            self._waiting = set()
            raise BandwidthProbeError(
                f"{back} of {TRAIN} probe Pongs ({size} bytes each) came back in time"
            ) from None
        times = [self._arrivals[nonce] for nonce in nonces[TRAIN // 2 - 1 :]]
        seconds = times[-1] - times[0]
        mean_i, mean_t = (len(times) - 1) / 2, sum(times) / len(times)
        slope = sum((i - mean_i) * (t - mean_t) for i, t in enumerate(times)) / sum(
            (i - mean_i) ** 2 for i in range(len(times))
        )
        one = link_pb2.LinkMessage(ping=link_pb2.Ping(nonce=nonces[-1], padding=padding))
        return len(one.SerializeToString()) * 8 / max(slope, 1e-9), seconds


__all__ = ["PROBE_BIT", "BandwidthMeter", "BandwidthProbeError", "Measurement"]
