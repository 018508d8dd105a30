"""Per-source admission at the WAN port: one stranger cannot crowd the genuine peer out.

The WAN port is open to the internet by design, and everything it does before a handshake completes
(waiting for a preamble, a TLS handshake on a thread, relaying a gRPC peer's bytes) costs descriptors,
tasks and threads. Global caps alone let one host take them all: 16 stalled raw TLS handshakes kept the
genuine peer out. So every connection the raw front end (``wan_frontend.WanFrontend``) accepts holds a slot of
its source address until its mutual TLS handshake completes (raw) or for its whole life (relayed to
gRPC, whose own handshake timeout ends a stranger's within seconds); a source at its cap, or the port at
its total, has further connections closed at accept, refused and audited per source and reason
(``RefusalAggregator``). Bounds, whatever arrives: ``MAX_PENDING`` connections (two descriptors each
when relayed) and ``MAX_RAW_HANDSHAKES`` threads.

A genuine peer needs at most 16 lane connections and their reconnects, from one address: well inside
``PER_SOURCE_RELAYED``; its raw handshakes take a few milliseconds each, so ``PER_SOURCE_PENDING``
leaves it room beside any number of other sources' stalled ones.

Many sources together (a flood from a botnet, or one host with many IPv6 addresses) can still fill the
totals. So an address from which a connection passed mutual TLS (``trust``: a raw connection's
handshake, or a relayed one that outlived the handshake timeout, which gRPC only allows one that
finished it) is **known** for ``TRUSTED_FOR_S``: it is not counted against the totals, only against its
own per-source caps. And relayed connections of unknown addresses together stay ``UNTRUSTED_ROOM``
below the gRPC WAN server's connection cap, so the peer's lanes always find room there. A peer that
has never connected, or comes back from a new address, is not helped: it competes like anyone else.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable

PER_SOURCE_PENDING = 8
"""Connections of one source address not yet through mutual TLS (idle, in a preamble or a handshake)."""
PER_SOURCE_RELAYED = 48
"""Connections of one source address relayed to the gRPC WAN server (a gRPC link's 32 lanes and reconnects;
the gRPC server caps all of them at ``NEBULA_SWITCH_WAN_MAX_CONNECTIONS``)."""
MAX_PENDING = 512
"""Connections of all sources not yet through mutual TLS, or relayed."""
TRUSTED_FOR_S = 24 * 3600.0
"""How long an address stays known after its last connection that passed mutual TLS."""
TRUSTED_MAX = 256
"""Known addresses kept (the least recently seen forgotten first)."""
UNTRUSTED_ROOM = 16
"""Connections of the gRPC WAN server's cap left to known addresses (a peer's lanes and reconnects)."""


class SourceLimits:
    """Slots per source address (host, no port) in two kinds: ``pending`` and ``relayed``."""

    def __init__(
        self,
        per_source_pending: int = PER_SOURCE_PENDING,
        per_source_relayed: int = PER_SOURCE_RELAYED,
        total: int = MAX_PENDING,
        relayed_untrusted: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._caps = {"pending": per_source_pending, "relayed": per_source_relayed}
        self._total = total
        #: Relayed connections of unknown addresses, all together (None: only ``total`` bounds them).
        self._relayed_untrusted = relayed_untrusted
        self._held: dict[str, Counter[str]] = {"pending": Counter(), "relayed": Counter()}
        self._trusted: OrderedDict[str, float] = OrderedDict()  # address -> last seen authenticated
        self._clock = clock

    def trust(self, source: str) -> None:
        """A connection from ``source`` passed mutual TLS: the address is known from now on."""
        self._trusted.pop(source, None)
        self._trusted[source] = self._clock()
        while len(self._trusted) > TRUSTED_MAX:
            self._trusted.popitem(last=False)

    def trusted(self, source: str) -> bool:
        seen = self._trusted.get(source)
        if seen is None:
            return False
        if self._clock() - seen > TRUSTED_FOR_S:
            del self._trusted[source]
            return False
        return True

    def _untrusted(self, kind: str) -> int:
        return sum(n for source, n in self._held[kind].items() if source not in self._trusted)

    @property
    def held(self) -> int:
        """Slots held now, all sources and kinds (at most ``total``)."""
        return sum(self._held["pending"].values()) + sum(self._held["relayed"].values())

    def held_by(self, source: str) -> int:
        """Slots ``source`` holds now, both kinds."""
        return self._held["pending"][source] + self._held["relayed"][source]

    def admit(self, source: str, kind: str = "pending") -> str | None:
        """Take a slot of ``kind`` for ``source``; None if taken, else the reason it was refused."""
        held = self._held[kind]
        if held[source] >= self._caps[kind]:
            return f"more than {self._caps[kind]} {kind} connections from one address"
        if not self.trusted(source):
            if self.held - self._held_trusted() >= self._total:
                return f"more than {self._total} connections before their handshake, all addresses"
            cap = self._relayed_untrusted
            if kind == "relayed" and cap is not None and self._untrusted("relayed") >= cap:
                return f"more than {cap} relayed connections of addresses not yet authenticated"
        held[source] += 1
        return None

    def _held_trusted(self) -> int:
        return sum(self.held_by(source) for source in self._trusted)

    def move(self, source: str, kind: str) -> str | None:
        """Turn ``source``'s pending slot into one of ``kind`` (None, or why refused: the slot is gone)."""
        self.release(source, "pending")
        return self.admit(source, kind)

    def release(self, source: str, kind: str = "pending") -> None:
        held = self._held[kind]
        if held[source] <= 1:
            held.pop(source, None)
        else:
            held[source] -= 1
