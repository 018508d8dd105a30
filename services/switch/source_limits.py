"""Per-source admission at the WAN port: one stranger cannot crowd the genuine peer out.

The WAN port is open to the internet by design, and everything it does before a handshake completes
(waiting for a preamble, a TLS handshake on a thread, relaying a gRPC peer's bytes) costs descriptors,
tasks and threads. Global caps alone let one host take them all: 16 stalled raw TLS handshakes kept the
genuine peer out. So every connection the raw front end (``rawlink.WanFrontend``) accepts holds a slot of
its source address until its mutual TLS handshake completes (raw) or for its whole life (relayed to
gRPC, whose own handshake timeout ends a stranger's within seconds); a source at its cap, or the port at
its total, has further connections closed at accept, refused and audited per source and reason
(``RefusalAggregator``). Bounds, whatever arrives: ``MAX_PENDING`` connections (two descriptors each
when relayed) and ``MAX_RAW_HANDSHAKES`` threads.

A genuine peer needs at most 16 lane connections and their reconnects, from one address: well inside
``PER_SOURCE_RELAYED``; its raw handshakes take a few milliseconds each, so ``PER_SOURCE_PENDING``
leaves it room beside any number of other sources' stalled ones.
"""

from __future__ import annotations

from collections import Counter

PER_SOURCE_PENDING = 8
"""Connections of one source address not yet through mutual TLS (idle, in a preamble or a handshake)."""
PER_SOURCE_RELAYED = 32
"""Connections of one source address relayed to the gRPC WAN server (a gRPC link's lanes and reconnects;
the gRPC server caps all of them at ``NEBULA_SWITCH_WAN_MAX_CONNECTIONS``)."""
MAX_PENDING = 512
"""Connections of all sources not yet through mutual TLS, or relayed."""


class SourceLimits:
    """Slots per source address (host, no port) in two kinds: ``pending`` and ``relayed``."""

    def __init__(
        self,
        per_source_pending: int = PER_SOURCE_PENDING,
        per_source_relayed: int = PER_SOURCE_RELAYED,
        total: int = MAX_PENDING,
    ) -> None:
        self._caps = {"pending": per_source_pending, "relayed": per_source_relayed}
        self._total = total
        self._held: dict[str, Counter[str]] = {"pending": Counter(), "relayed": Counter()}

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
        if self.held >= self._total:
            return f"more than {self._total} connections before their handshake, all addresses"
        held[source] += 1
        return None

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
