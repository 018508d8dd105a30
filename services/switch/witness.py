"""Witnessed audit on the link: send this switch's audit head, record the peer's.

Each switch sends the head of its own audit chain (``AuditLog.head``: log id, records, last hash) to its
peer every ``WITNESS_INTERVAL_S`` while the link is up (and at once when a session starts), if the head
moved; the peer records each one in its own audit log (``audit.witness``), where the other organisation
keeps it beyond the reach of whoever runs or breaks into this switch. ``nebula audit verify --witness``
(``nebula_common/audit/witness.py``) later proves the log was not rewritten up to the newest witnessed
head. A head that goes back (fewer records, or another hash for the same count of the same log) is
evidence of a rewrite or a rollback seen live: it is recorded with outcome ``refused`` and logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from nebula_common.audit import AuditLog
from nebula_common.audit.records import utc_timestamp
from nebula_common.audit.witness import WITNESS_EVENT
from nebula_common.proto.nebula.v1 import link_pb2
from services.switch.metrics import AUDIT_WITNESSED

log = logging.getLogger(__name__)

WITNESS_INTERVAL_S = 60.0
"""How often a switch sends its audit head to each peer (when it moved). Each head adds one record to
the peer's log, so this bounds what witnessing costs: about 1,440 records a day per peer."""

RecordFn = Callable[..., None]


class AuditWitness:
    """Both halves of witnessing on one peer link: this switch's head out, the peer's heads in."""

    def __init__(self, audit: AuditLog | None, peer_cluster_id: str, record: RecordFn) -> None:
        self.audit = audit
        self.peer_cluster_id = peer_cluster_id
        self._record = record
        self._sent: tuple[str, int] | None = None
        self._next_send = 0.0
        self._seen: dict[str, tuple[int, str]] = {}  # the peer's log id -> (count, head) last witnessed
        self._next_record = 0.0
        #: Heads the peer sent faster than every half interval, not recorded (see ``received``).
        self.dropped = 0

    def session_started(self) -> None:
        """Send the head at the next tick: a new session may follow a gap in witnessing."""
        self._sent = None
        self._next_send = 0.0

    def due(self, now: float | None = None) -> link_pb2.LinkMessage | None:
        """This switch's head, when the interval has passed and it moved since the last one sent."""
        if self.audit is None:
            return None
        now = time.monotonic() if now is None else now
        if now < self._next_send:
            return None
        self._next_send = now + WITNESS_INTERVAL_S
        log_id, count, head = self.audit.head()
        if self._sent == (log_id, count):
            return None
        self._sent = (log_id, count)
        return link_pb2.LinkMessage(
            audit_head=link_pb2.AuditHead(log_id=log_id, count=count, head=head, read_at=utc_timestamp())
        )

    def received(self, head: link_pb2.AuditHead, now: float | None = None) -> None:
        """Record the peer's head in this switch's audit log (``audit.witness``).

        At most one head per half interval is recorded: a hostile peer flooding heads would otherwise
        fill this switch's audit log and rotate its own history out of it.
        """
        now = time.monotonic() if now is None else now
        if now < self._next_record:
            self.dropped += 1
            return
        self._next_record = now + WITNESS_INTERVAL_S / 2
        details = {
            "peer": self.peer_cluster_id,
            "log_id": head.log_id,
            "count": head.count,
            "head": head.head,
            "read_at": head.read_at,
        }
        last = self._seen.get(head.log_id)
        problem = ""
        if last is not None and head.count < last[0]:
            problem = f"the peer's audit log went back from {last[0]} to {head.count} records"
        elif last is not None and head.count == last[0] and head.head != last[1]:
            problem = f"record {head.count} of the peer's audit log changed since it was witnessed"
        if problem:
            log.error("audit witness: %s", problem, extra={"fields": details})
            self._record(WITNESS_EVENT, outcome="refused", reason=problem, **details)
            return
        self._seen[head.log_id] = (head.count, head.head)
        AUDIT_WITNESSED.labels(self.peer_cluster_id).set(head.count)
        self._record(WITNESS_EVENT, **details)
