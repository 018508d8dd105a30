"""Routes between local trainer streams and the WAN link, keyed by (job, edge).

Each model edge crosses the cluster boundary exactly once, so a cluster holds
exactly one end of it: everything arriving from the peer for (job, edge) goes
to the one local stream that opened that edge. Frames may arrive before the
local trainer attaches (the two clusters start independently), so a route is
created by whichever comes first and buffers, with a bound, until the trainer
attaches: back-pressure then reaches the peer through the link.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from nebula_common.proto.nebula.v1 import relay_pb2

RouteKey = tuple[str, str]


class RouteInUseError(Exception):
    """A second local stream tried to open an edge that is already open."""


@dataclass
class Route:
    key: RouteKey
    inbound: asyncio.Queue[relay_pb2.EdgeMessage]
    attached: bool = False
    owner: str = ""
    remote_closed: bool = False
    created_at: float = field(default_factory=lambda: asyncio.get_running_loop().time())


JOB_OWNERS_REMEMBERED = 100_000
"""Job ids whose owning account the switch remembers (oldest forgotten first); far above live jobs."""


class Router:
    def __init__(self, buffer_messages: int) -> None:
        self._buffer_messages = buffer_messages
        self._routes: dict[RouteKey, Route] = {}
        # job id -> account that first attached an edge of it. A job's edges belong to one account,
        # so once claimed, no other account of this cluster can attach to (and read) any of its edges,
        # even after the owner's stream ended (a restarted stage re-attaches under the same account).
        self._job_owners: dict[str, str] = {}

    def _get_or_create(self, key: RouteKey) -> Route:
        route = self._routes.get(key)
        if route is None:
            route = Route(key=key, inbound=asyncio.Queue(maxsize=self._buffer_messages))
            self._routes[key] = route
        return route

    def attach(self, key: RouteKey, owner: str) -> Route:
        """Bind the local end of an edge to a trainer stream opened by account ``owner``."""
        claimed_by = self._job_owners.get(key[0])
        if claimed_by is not None and claimed_by != owner:
            # Same answer as a busy edge: another account's job is not ours to confirm or deny.
            raise RouteInUseError(f"edge {key[1]!r} of job {key[0]!r} is not available to this account")
        route = self._get_or_create(key)
        if route.attached:
            raise RouteInUseError(f"edge {key[1]!r} of job {key[0]!r} is already open on this switch")
        route.attached = True
        route.owner = owner
        if claimed_by is None:
            self._job_owners[key[0]] = owner
            while len(self._job_owners) > JOB_OWNERS_REMEMBERED:
                del self._job_owners[next(iter(self._job_owners))]
        return route

    def get(self, key: RouteKey) -> Route | None:
        """The route for ``key`` if one exists (attached or still buffering)."""
        return self._routes.get(key)

    def detach(self, key: RouteKey) -> None:
        self._routes.pop(key, None)

    async def deliver(self, key: RouteKey, message: relay_pb2.EdgeMessage) -> None:
        """Queue a message from the peer for the local end (waits while the buffer is full)."""
        route = self._get_or_create(key)
        if message.WhichOneof("body") == "close":
            if not route.attached:
                # Nobody here ever opened this edge: drop what was buffered for it.
                self._routes.pop(key, None)
                return
            route.remote_closed = True
        await route.inbound.put(message)

    def open_routes(self) -> int:
        return sum(1 for route in self._routes.values() if route.attached)

    async def fail_all(self, reason: str) -> None:
        """Tell every attached trainer that the link carrying its edge is gone."""
        for route in list(self._routes.values()):
            if route.attached and not route.remote_closed:
                route.remote_closed = True
                message = relay_pb2.EdgeMessage(close=relay_pb2.EdgeClose(reason=reason, error=True))
                try:
                    route.inbound.put_nowait(message)
                except asyncio.QueueFull:
                    route.inbound.get_nowait()
                    route.inbound.put_nowait(message)
