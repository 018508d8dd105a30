"""Refusal records a stranger cannot multiply: one per source, layer and reason per interval, with a count.

A port open to the internet (the switch's WAN port) refuses whoever is not its peer, and every refusal
is audited. Written one record each, a stranger's loop of garbage connections fills the audit disk (300
records in half a second from one client), and a full audit disk stops the cluster. So refusals are
aggregated: the first refusal of a key (source host, layer, reason) is written at once, so an operator
sees it immediately and tests can wait for it; repeats within the interval are counted and written as
one record with ``count`` when the interval ends (at the next refusal or ``flush``). At most
``max_keys`` keys are tracked per interval; beyond them refusals fold into one key per layer
(``source: "*"``). So the records per interval are bounded, whatever arrives: at most
``2 * max_keys`` plus one per layer (with the defaults, under 140 a minute).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Append = Callable[..., Any]
DEFAULT_INTERVAL_S = 60.0
DEFAULT_MAX_KEYS = 64
OVERFLOW_REASON = "more refusals than tracked keys"


def source_host(address: object) -> str:
    """The host part of a gRPC peer string or ``host:port`` (``ipv4:1.2.3.4:5`` -> ``1.2.3.4``)."""
    text = str(address or "")
    for prefix in ("ipv4:", "ipv6:", "unix:"):
        if text.startswith(prefix):
            text = text[len(prefix) :]
            break
    if text.startswith("["):  # [v6]:port
        return text[1:].partition("]")[0] or "unknown"
    host, sep, port = text.rpartition(":")
    return (host if sep and port.isdigit() else text) or "unknown"


@dataclass
class _Pending:
    event: str
    count: int = 0
    first_seen: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)


class RefusalAggregator:
    """Aggregates refusal records for one audit log (thread-safe; see the module docstring)."""

    def __init__(
        self,
        append: Append,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        max_keys: int = DEFAULT_MAX_KEYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0 or max_keys < 1:
            raise ValueError("interval_s must be positive and max_keys at least 1")
        self._append = append
        self._interval = interval_s
        self._max_keys = max_keys
        self._clock = clock
        self._lock = threading.Lock()
        self._window_start = clock()
        self._pending: dict[tuple[str, str, str, str], _Pending] = {}

    def refused(self, event: str, layer: str, reason: str, details: dict[str, Any]) -> None:
        """One refusal (``details`` may name its ``address``): written now if new, else counted."""
        now = self._clock()
        source = source_host(details.get("address"))
        key = (event, source, layer, reason)
        with self._lock:
            if now - self._window_start >= self._interval:
                self._flush_locked()
                self._window_start = now
            pending = self._pending.get(key)
            if pending is None and len(self._pending) >= self._max_keys:
                key = (event, "*", layer, "")
                pending = self._pending.get(key)
                if pending is None:  # the overflow key of this layer: a record now, the count later
                    overflow = {"layer": layer, "reason": OVERFLOW_REASON}
                    self._pending[key] = _Pending(event, 0, now, overflow)
                    self._write(event, {**overflow, "source": "*", "count": 1})
                    return
            if pending is None:
                self._pending[key] = _Pending(event, 0, now, {**details, "layer": layer, "reason": reason})
                self._write(
                    event, {**details, "layer": layer, "reason": reason, "source": source, "count": 1}
                )
                return
            pending.count += 1

    def tick(self) -> None:
        """Write the repeats once the interval is over (a periodic task calls this; cheap otherwise)."""
        with self._lock:
            if self._clock() - self._window_start >= self._interval:
                self._flush_locked()
                self._window_start = self._clock()

    def flush(self) -> None:
        """Write the counted repeats of the current interval now (a stop, or a periodic tick)."""
        with self._lock:
            self._flush_locked()
            self._window_start = self._clock()

    def _flush_locked(self) -> None:
        pending, self._pending = self._pending, {}
        for (_event, source, _layer, _reason), entry in pending.items():
            if entry.count:
                self._write(
                    entry.event,
                    {
                        **entry.details,
                        "source": source,
                        "count": entry.count,
                        "repeats_within_s": round(self._interval, 3),
                    },
                )

    def _write(self, event: str, details: dict[str, Any]) -> None:
        self._append(event, outcome="refused", details=details)
