"""Why and how the switch closes a route itself: a bound exceeded, a timeout, a revoked credential.

A route over any bound (``route_limits.py``) is closed: an error close naming this switch, the bound and
the numbers goes to the sender (across the link) and to the local trainer if one is attached, buffered
items are dropped, the key is tombstoned for ``tombstone_s`` (later items for it are dropped), and
``route.closed`` is audited and counted. The same close ends a route left without a trainer past its
timeout (``unattached_timeout_s``; ``orphan_timeout_s`` when its trainer vanished: the error close to the
peer names this cluster and the timeout, audited with the owning account) and a route whose owner's
token or certificate was revoked or whose token expired unrenewed. A new route the switch cannot take
(too many unattached routes) is refused the same way, before it exists.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from nebula_common.proto.nebula.v1 import link_pb2, relay_pb2
from services.switch.metrics import ROUTES_CLOSED
from services.switch.route_limits import (
    ATTACHED_MAX_ITEMS,
    INITIAL_WINDOW_BYTES,
    REPLAY_FACTOR,
    SLACK_BYTES,
    TOMBSTONES_MAX,
    UNATTACHED_MAX_ITEMS,
)
from services.switch.route_state import ORPHANED, Item, Route, RouteKey
from services.switch.route_table import RouteTable


class RouteClosing(RouteTable):
    """Closing routes over a bound or past their time, refusing new ones, and their tombstones."""

    def _within_bounds(self, route: Route) -> bool:
        """Close ``route`` if its buffer toward the trainer exceeds a bound; True if it is within."""
        if route.attachment is not None:
            bound = self.limits.route_bound_bytes
            if route.inbound_bytes > bound:
                self.close_route(
                    route,
                    "window",
                    f"{route.inbound_bytes} bytes buffered for the receiving trainer, above the route's "
                    f"bound of {bound} ({REPLAY_FACTOR} x max_window_bytes {self.limits.max_window_bytes}"
                    f" + slack {SLACK_BYTES}): the sender exceeded the credit of the receiver, or the "
                    "receiver does not read",
                )
                return False
            if route.inbound_items > ATTACHED_MAX_ITEMS:
                self.close_route(
                    route,
                    "items",
                    f"{route.inbound_items} items buffered for the receiving trainer, above the route's "
                    f"bound of {ATTACHED_MAX_ITEMS} items",
                )
                return False
            return True
        bound = INITIAL_WINDOW_BYTES + SLACK_BYTES
        if route.inbound_bytes > bound:
            self.close_route(
                route,
                "unattached_bytes",
                f"{route.inbound_bytes} bytes buffered with no receiver attached, above the bound of "
                f"{bound} (initial window {INITIAL_WINDOW_BYTES} + slack {SLACK_BYTES})",
            )
            return False
        if route.inbound_items > UNATTACHED_MAX_ITEMS:
            self.close_route(
                route,
                "unattached_items",
                f"{route.inbound_items} items buffered with no receiver attached, above the bound of "
                f"{UNATTACHED_MAX_ITEMS} items",
            )
            return False
        return True

    def close_route(self, route: Route, label: str, detail: str) -> None:
        """Close a route over a bound: error close to the sender and the local trainer, tombstone, audit."""
        if route.closed_reason is not None:
            return
        job_id, edge = route.key
        reason = (
            f"switch {self.cluster_id!r} closed edge {edge!r} of job {job_id!r} (bound {label}): {detail}"
        )
        route.closed_reason = reason
        close = relay_pb2.EdgeClose(reason=reason, error=True)
        self._drop_inbound(route)
        self._purge_outbound(route, keep_close=False)
        self._queue_control(route.key, close, route.epoch)
        if route.attachment is not None:
            message = relay_pb2.EdgeMessage(close=close)
            size = message.ByteSize()
            route.inbound.append(Item(message, size, route.epoch))
            route.inbound_bytes += size
            self.buffered_in += size
            route.attachment.wake.set()
        if self._routes.get(route.key) is route:
            del self._routes[route.key]
        self._tombstone(route.key, route.epoch)
        self._closed(route.key, route.owner, label, reason)

    def renew(self, job_id: str, owner: str, issued_at: float, expires_at: float) -> int:
        """The open routes of ``owner``'s job ``job_id`` now run on a token issued at ``issued_at`` that
        expires at ``expires_at`` (its trainer renewed the job's token); returns how many."""
        renewed = 0
        for route in self._routes.values():
            if route.key[0] == job_id and route.owner == owner and route.closed_reason is None:
                route.issued_at = max(route.issued_at, issued_at)
                route.expires_at = max(route.expires_at, expires_at)
                renewed += 1
        return renewed

    def close_revoked(
        self,
        reason_of: Callable[[str, float], str | None],
        revoked_serials: frozenset[int] = frozenset(),
        expired_before: float = 0.0,
    ) -> int:
        """Close every route whose credential is revoked now: its owner's token (``reason_of(owner,
        issued_at)`` says why: account disabled, deleted, new password), the certificate its trainer
        presented (its serial on the cluster CA's CRL), or a token that expired before
        ``expired_before`` (wall clock) and was not renewed. Both trainers get the reason; returns how
        many were closed."""
        closed = 0
        for route in list(self._routes.values()):
            if not route.owner or route.closed_reason is not None:
                continue
            reason = reason_of(route.owner, route.issued_at)
            if reason is not None:
                reason = f"account {route.owner!r}: {reason}"
            elif route.serial and route.serial in revoked_serials:
                reason = f"the certificate {route.serial:x} its trainer opened it with is revoked"
            elif route.expires_at and route.expires_at < expired_before:
                expired = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(route.expires_at))
                reason = f"account {route.owner!r}: the token it runs on expired at {expired}, not renewed"
            if reason is not None:
                self.close_route(route, "credential", reason)
                closed += 1
        return closed

    def _refuse_new(self, key: RouteKey, label: str, detail: str, epoch: int) -> None:
        reason = (
            f"switch {self.cluster_id!r} refused edge {key[1]!r} of job {key[0]!r} (bound {label}): {detail}"
        )
        self._queue_control(key, relay_pb2.EdgeClose(reason=reason, error=True), epoch)
        self._tombstone(key, epoch)
        self._closed(key, "", label, reason)

    def _closed(self, key: RouteKey, account: str, label: str, reason: str) -> None:
        ROUTES_CLOSED.labels(label).inc()
        if self.record is not None:
            self.record(
                "route.closed",
                outcome="refused",
                account=account or self._job_owners.get(key[0], ""),
                job_id=key[0],
                edge=key[1],
                bound=label,
                reason=reason,
            )

    def _queue_control(self, key: RouteKey, close: relay_pb2.EdgeClose, epoch: int) -> None:
        self._control.append(
            link_pb2.LinkMessage(
                routed=link_pb2.RoutedItem(
                    job_id=key[0], edge=key[1], item=relay_pb2.EdgeMessage(close=close), epoch=epoch
                )
            )
        )
        self.outbound_wake.set()

    def _tombstone(self, key: RouteKey, epoch: int) -> None:
        self._tombstones.pop(key, None)
        self._tombstones[key] = (self._clock() + self.limits.tombstone_s, epoch)
        while len(self._tombstones) > TOMBSTONES_MAX:
            self._tombstones.popitem(last=False)

    # ----- time ------------------------------------------------------------------------------
    def sweep(self) -> None:
        """Expire tombstones and close routes left without a trainer for longer than allowed."""
        now = self._clock()
        while self._tombstones:
            key, (expiry, _) = next(iter(self._tombstones.items()))
            if expiry > now:
                break
            del self._tombstones[key]
        timeout = self.limits.unattached_timeout_s
        orphan_timeout = self.limits.orphan_timeout_s
        for route in list(self._routes.values()):
            if route.attachment is not None:
                continue
            waited = now - route.unattached_since
            if route.detached == ORPHANED:
                if waited > orphan_timeout:
                    self.close_route(
                        route,
                        "orphan_timeout",
                        f"the stage of cluster {self.cluster_id!r} vanished (its stream ended without a "
                        f"close) and did not re-attach within {orphan_timeout:g} s (orphan_timeout_s)",
                    )
            elif waited > timeout:
                self.close_route(
                    route,
                    "unattached_timeout",
                    f"no receiver attached within {timeout:g} s (unattached_timeout_s); "
                    f"{route.inbound_bytes} bytes in {route.inbound_items} items dropped",
                )

    async def run_sweeper(self) -> None:
        period = min(1.0, self.limits.unattached_timeout_s / 4, self.limits.orphan_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            self.sweep()
