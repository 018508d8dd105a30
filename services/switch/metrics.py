"""Prometheus metrics of the switch and the byte accounting behind GetLinkStatus.

The same numbers feed both, so a dashboard and the demo's JSON summary can
never disagree about how many bytes crossed the WAN.

Per-job series (``nebula_switch_job_*{job_id,direction,peer}``) count the routed items of each job
on the link to each peer, so a job's summary shows its own bytes and codec ratio, not the lifetime sums of
every job the switch carried. They leave ``/metrics`` once the job has no edge open on this
switch and nothing of it crossed the link for a grace period (``JobSeries``): long enough for
the summary and the last scrape to read the final values, short enough that a switch carrying
thousands of jobs does not export every one forever.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter as Tally
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import Counter, Gauge

from nebula_common.proto.nebula.v1 import link_pb2, relay_pb2
from nebula_common.rpc.framing import FramedChunk

WAN_BYTES = Counter(
    "nebula_switch_wan_bytes",
    "Serialized link-message bytes exchanged with the peer switch.",
    ["direction"],
)
WAN_PAYLOAD_BYTES = Counter(
    "nebula_switch_wan_payload_bytes", "Encoded tensor payload bytes exchanged with the peer.", ["direction"]
)
WAN_RAW_BYTES = Counter(
    "nebula_switch_wan_raw_bytes",
    "Bytes the relayed tensors would have taken without compression.",
    ["direction"],
)
FRAMES_RELAYED = Counter("nebula_switch_frames_relayed", "Tensor frames relayed over the WAN.", ["direction"])
LINK_UP = Gauge("nebula_switch_link_up", "1 while an authenticated link to the peer switch is up.")
PEER_LINK_UP = Gauge(
    "nebula_switch_peer_link_up",
    "1 while the authenticated link to this peer switch is up (one series per configured peer; "
    "nebula_switch_link_up is 1 while every peer's link is up).",
    ["peer"],
)
LINK_CONNECTIONS = Gauge(
    "nebula_switch_link_connections",
    "Connections (lanes) the link to this peer switch stripes items over right now (0 while down; "
    "NEBULA_SWITCH_LINK_CONNECTIONS on the dialing switch: a fixed count or auto), per peer.",
    ["peer"],
)
EDGES_OPEN = Gauge("nebula_switch_edges_open", "Local trainer edge streams currently open.")
AUDIT_WITNESSED = Gauge(
    "nebula_switch_audit_witnessed_records",
    "Records of the peer switch's audit log this switch has witnessed (the count of the newest head it "
    "recorded as audit.witness), per peer.",
    ["peer"],
)
AUTH_REFUSALS = Counter(
    "nebula_switch_refusals", "WAN link attempts refused by the switch, by layer.", ["port", "reason"]
)
for _layer in ("tls", "identity", "handshake", "revoked"):
    AUTH_REFUSALS.labels("wan", _layer)  # export zeros from the start: dashboards and alerts see the series
ROUTES_CLOSED = Counter(
    "nebula_switch_routes_closed",
    "Routes the switch closed itself because a bound was exceeded, by bound.",
    ["reason"],
)
for _bound in (
    "window",
    "items",
    "credit",
    "unattached_bytes",
    "unattached_items",
    "unattached_timeout",
    "unattached_routes",
    "orphan_timeout",
):
    ROUTES_CLOSED.labels(_bound)
ITEMS_DROPPED = Counter(
    "nebula_switch_items_dropped",
    "Items from the peer dropped because their route was closed by the switch, or because the local "
    "trainer of their epoch vanished (its reconnect makes the peer replay them).",
)
STALE_ITEMS = Counter(
    "nebula_switch_stale_items",
    "Items from the peer dropped because their epoch is below their route's (an attempt already "
    "replaced by a restart; relay.proto, 'Epochs').",
)
ITEMS_SUPERSEDED = Counter(
    "nebula_switch_items_superseded",
    "Queued frames and signals dropped because the sender's replay (a retransmit-timeout or resume "
    "rewind, or a reconnect) resends them behind: the copy takes the original's place in the queue "
    "(to_peer: from a local trainer, waiting for the link; to_trainers: from the peer).",
    ["direction"],
)
for _direction in ("to_peer", "to_trainers"):
    ITEMS_SUPERSEDED.labels(_direction)
BUFFERED_BYTES = Gauge(
    "nebula_switch_buffered_bytes",
    "Bytes of edge items this switch holds in its route buffers (to_trainers: from the peer; to_peer: "
    "from local trainers, waiting for the link).",
    ["direction"],
)
ITEMS_READ = Counter(
    "nebula_switch_items_read",
    "Items (frames, chunks, signals, acks) read from local trainers' edges, by account.",
    ["account"],
)
THROTTLED_SECONDS = Counter(
    "nebula_switch_throttled_seconds",
    "Time the switch stopped reading an account's edges because it exceeded its item rate "
    "(NEBULA_SWITCH_ACCOUNT_ITEM_RATE), by account.",
    ["account"],
)
PENALTIES = Counter(
    "nebula_switch_penalties",
    "Routes of this switch's accounts closed for a bound their sender exceeded (each one a strike toward "
    "the account's open backoff and a reduced item rate for the job), by bound.",
    ["bound"],
)
OPENS_REFUSED = Counter(
    "nebula_switch_penalty_refusals",
    "OpenEdge calls refused because the account is in a penalty backoff, by account.",
    ["account"],
)
LINK_RTT = Gauge(
    "nebula_switch_link_rtt_seconds",
    "Smoothed round-trip time to this peer switch (RFC 6298 SRTT, Ping/Pong), per peer.",
    ["peer"],
)
LINK_INFLIGHT = Gauge(
    "nebula_switch_link_inflight_bytes",
    "Bytes of items written to this peer switch that it has not read yet (a paced link; 0 otherwise).",
    ["peer"],
)
LINK_INFLIGHT_LIMIT = Gauge(
    "nebula_switch_link_inflight_limit_bytes",
    "The paced link's cap on those bytes: about one bandwidth-delay product and two fragments "
    "(services/switch/pacing.py; 0 on a link that is not paced).",
    ["peer"],
)
LINK_DELIVERY_RATE = Gauge(
    "nebula_switch_link_delivery_rate_bytes",
    "Delivery rate toward this peer switch as the paced link estimates it, bytes per second.",
    ["peer"],
)

JOB_WAN_BYTES = Counter(
    "nebula_switch_job_wan_bytes",
    "Serialized bytes of a job's routed items exchanged with the peer switch (frames, chunks, signals, "
    "acks, closes), per job and peer switch.",
    ["job_id", "direction", "peer"],
)
JOB_WAN_PAYLOAD_BYTES = Counter(
    "nebula_switch_job_wan_payload_bytes",
    "Encoded tensor payload bytes of a job exchanged with the peer, per job and peer switch.",
    ["job_id", "direction", "peer"],
)
JOB_WAN_RAW_BYTES = Counter(
    "nebula_switch_job_wan_raw_bytes",
    "Bytes a job's relayed tensors would have taken without compression, per job and peer switch.",
    ["job_id", "direction", "peer"],
)
JOB_FRAMES = Counter(
    "nebula_switch_job_frames_relayed",
    "Tensor frames of a job relayed over the WAN, per job and peer switch.",
    ["job_id", "direction", "peer"],
)
PER_JOB = (JOB_WAN_BYTES, JOB_WAN_PAYLOAD_BYTES, JOB_WAN_RAW_BYTES, JOB_FRAMES)
DIRECTIONS = ("sent", "received")
JOB_SERIES_GRACE_S = 120.0
"""How long a job's series stay after its last edge on this switch closed and its last item crossed."""


class JobSeries:
    """Which jobs have per-job series, and when each may go (see the module doc).

    A job's series go once no local edge of it is open and nothing of it was counted for
    ``grace_s``. Checked at most once a second from the counting path and the edge hooks (the
    link's keepalive counts a message every few seconds even when idle), so it needs no thread.
    """

    def __init__(self, grace_s: float = JOB_SERIES_GRACE_S) -> None:
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._open: Tally[str] = Tally()
        self._last: dict[str, float] = {}
        self._peers: dict[str, set[str]] = {}  # the peers each job's series are labelled with
        self._next_sweep = 0.0

    def opened(self, job_id: str) -> None:
        """A local trainer opened an edge of ``job_id``: its series stay while it is open."""
        with self._lock:
            self._open[job_id] += 1
            self._last[job_id] = time.monotonic()
        self.sweep()

    def closed(self, job_id: str) -> None:
        """That edge closed (however): the grace period starts when the job's last edge is gone."""
        with self._lock:
            self._open[job_id] -= 1
            if self._open[job_id] <= 0:
                del self._open[job_id]
            self._last[job_id] = time.monotonic()
        self.sweep()

    def counted(self, job_id: str, peer: str = "") -> None:
        with self._lock:
            self._last[job_id] = time.monotonic()
            self._peers.setdefault(job_id, set()).add(peer)

    def sweep(self, now: float | None = None, force: bool = False) -> list[str]:
        """Remove the series of every job past its grace period; returns those job ids."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if not force and now < self._next_sweep:
                return []
            self._next_sweep = now + 1.0
            gone = [
                job
                for job, last in self._last.items()
                if job not in self._open and now - last >= self.grace_s
            ]
            peers = {job: self._peers.pop(job, {""}) for job in gone}
            for job in gone:
                del self._last[job]
        for job in gone:
            forget_job(job, peers[job])
        return gone


def forget_job(job_id: str, peers: Iterable[str] = ("",)) -> None:
    """Remove every per-job series of ``job_id`` with these peers now (unused label sets are skipped)."""
    for metric in PER_JOB:
        for direction in DIRECTIONS:
            for peer in peers:
                with contextlib.suppress(KeyError):
                    metric.remove(job_id, direction, peer)


JOB_SERIES = JobSeries()


@dataclass
class DirectionCounters:
    """Byte accounting for one direction of the WAN link (to or from ``peer``, the peer switch's cluster).

    The per-job series carry the peer, so a chain's middle cluster (a switch with two peers)
    counts each of a job's edges on its own.
    """

    direction: str
    peer: str = ""
    bytes: int = 0
    payload_bytes: int = 0
    raw_bytes: int = 0
    frames: int = 0

    def count(self, message: link_pb2.LinkMessage) -> None:
        size = message.ByteSize()
        self.bytes += size
        WAN_BYTES.labels(self.direction).inc(size)
        JOB_SERIES.sweep()  # at most once a second: ended jobs' series go
        if message.WhichOneof("body") != "routed":
            return
        job = message.routed.job_id
        JOB_SERIES.counted(job, self.peer)
        JOB_WAN_BYTES.labels(job, self.direction, self.peer).inc(size)
        if message.routed.item.WhichOneof("body") != "frame":
            return
        part = message.routed.item.frame
        if part.HasField("chunk"):
            payload = len(part.chunk.data)
            self.payload_bytes += payload
            WAN_PAYLOAD_BYTES.labels(self.direction).inc(payload)
            JOB_WAN_PAYLOAD_BYTES.labels(job, self.direction, self.peer).inc(payload)
        elif part.HasField("header"):
            self.frames += 1
            self.raw_bytes += part.header.raw_size
            FRAMES_RELAYED.labels(self.direction).inc()
            WAN_RAW_BYTES.labels(self.direction).inc(part.header.raw_size)
            JOB_FRAMES.labels(job, self.direction, self.peer).inc()
            JOB_WAN_RAW_BYTES.labels(job, self.direction, self.peer).inc(part.header.raw_size)

    def count_chunk(self, chunk: FramedChunk) -> None:
        """A framed chunk: its bytes on the link and its payload (no header, so no frame is counted).

        Counted per job too: framed chunks carry most of a job's bytes, so a summary built from the
        per-job series would otherwise miss them.
        """
        size = len(chunk.raw)
        self.bytes += size
        WAN_BYTES.labels(self.direction).inc(size)
        payload = len(chunk.data)
        self.payload_bytes += payload
        WAN_PAYLOAD_BYTES.labels(self.direction).inc(payload)
        JOB_SERIES.sweep()  # at most once a second: ended jobs' series go
        JOB_SERIES.counted(chunk.job_id, self.peer)
        JOB_WAN_BYTES.labels(chunk.job_id, self.direction, self.peer).inc(size)
        JOB_WAN_PAYLOAD_BYTES.labels(chunk.job_id, self.direction, self.peer).inc(payload)

    def to_proto(self) -> relay_pb2.LinkCounters:
        return relay_pb2.LinkCounters(
            bytes=self.bytes, payload_bytes=self.payload_bytes, raw_bytes=self.raw_bytes, frames=self.frames
        )
