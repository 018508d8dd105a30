"""What an emulated WAN link is: bandwidth, one-way delay, loss, MTU, and the bytes the wire carries.

Kept apart from the proxy so the shaper, the CLI and the kernel-shaping benchmark
(``bench/wan/link.py``, which configures ``tc tbf`` from the same numbers) share one definition.

The bandwidth is a *wire* bandwidth, as a kernel qdisc or a real circuit sees it: every TCP segment
carries Ethernet (14), IPv4 (20) and TCP-with-timestamps (32) headers, 66 bytes per segment of at most
``mtu - 52`` payload bytes. Counting payload only would make the emulator ~4.5% optimistic against
``tc tbf`` at MTU 1500, which is what the first version measured.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

# Ethernet header + IPv4 header + TCP header with the timestamp option (what Linux sends by default).
HEADER_BYTES_PER_SEGMENT = 66
# IPv4 + TCP-with-timestamps: the part of the headers that counts against the MTU.
_IP_TCP_HEADER_BYTES = 52
# A shaper's backlog: enough to keep the link busy between the proxy's wake-ups, small enough that
# a fast sender is pushed back by TCP flow control instead of parking megabytes here.
QUEUE_BYTES = 256 * 1024
_MIN_MTU = 576  # the smallest MTU every IPv4 host must accept (RFC 791)
_MAX_MTU = 65535


def _check_real(owner: str, name: str, value: object) -> None:
    # numbers.Real admits numpy scalars from configs; bool is excluded because accepting True
    # as "1 Mbit/s" would hide a caller bug.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{owner}.{name} must be a number, got {value!r}")


@dataclass(frozen=True)
class LinkShape:
    """One direction's link characteristics; the same shape is applied to both directions.

    ``loss`` is the probability that a TCP segment is lost (0.001 = 0.1%), modelled Reno-style by the
    shaper (see ``nebula_common.wan.shaper``); ``seed`` makes the losses repeatable.
    """

    bandwidth_mbit: float
    delay_ms: float
    loss: float = 0.0
    mtu: int = 1500
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("bandwidth_mbit", "delay_ms", "loss"):
            _check_real("LinkShape", name, getattr(self, name))
        if not math.isfinite(self.bandwidth_mbit) or self.bandwidth_mbit <= 0:
            raise ValueError(
                f"LinkShape.bandwidth_mbit must be a finite number > 0, got {self.bandwidth_mbit!r}"
            )
        if not math.isfinite(self.delay_ms) or self.delay_ms < 0:
            raise ValueError(f"LinkShape.delay_ms must be a finite number >= 0, got {self.delay_ms!r}")
        if not (math.isfinite(self.loss) and 0 <= self.loss < 0.5):
            raise ValueError(
                f"LinkShape.loss must be a probability in [0, 0.5) (0.001 = 0.1%), got {self.loss!r}"
            )
        if (
            isinstance(self.mtu, bool)
            or not isinstance(self.mtu, int)
            or not _MIN_MTU <= self.mtu <= _MAX_MTU
        ):
            raise ValueError(f"LinkShape.mtu must be an integer in {_MIN_MTU}..{_MAX_MTU}, got {self.mtu!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"LinkShape.seed must be an integer or None, got {self.seed!r}")

    @property
    def bits_per_second(self) -> float:
        return self.bandwidth_mbit * 1e6

    @property
    def delay_s(self) -> float:
        return self.delay_ms / 1000.0

    @property
    def mss(self) -> int:
        """Payload bytes per TCP segment at this MTU (1448 at 1500)."""
        return self.mtu - _IP_TCP_HEADER_BYTES

    def wire_bytes(self, payload: int) -> int:
        """Bytes on the wire for ``payload`` TCP payload bytes: n + 66 * ceil(n / mss)."""
        return payload + HEADER_BYTES_PER_SEGMENT * -(-payload // self.mss)

    @property
    def burst_bytes(self) -> int:
        """Token-bucket depth: one full-size segment on the wire (1514 bytes at MTU 1500).

        An idle link lends no more than one segment's serialisation time, so a message that follows
        an idle spell (every step's first activation) pays its full transfer time, as on a real
        circuit. The pacer does not need a deeper bucket to keep a busy link at its rate: it charges
        each chunk from its arrival on a virtual clock (``nebula_common.wan.shaper``), so a late
        wake-up is caught up, not lost. The kernel reference (``bench/wan/link.py``) gives ``tc tbf``
        the same depth.
        """
        return self.wire_bytes(self.mss)

    @property
    def queue_limit_bytes(self) -> int:
        """Bytes one connection may hold inside the emulator (its share of the pipe plus the queue).

        The shaper's aggregate backlog is bounded separately (``QUEUE_BYTES``); this bound keeps a
        connection whose receiver stops reading from parking more than a bandwidth-delay product.
        """
        bdp = self.bits_per_second / 8.0 * self.delay_s
        return math.ceil(bdp) + QUEUE_BYTES
