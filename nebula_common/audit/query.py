"""Filtering an audit log for the admin query API and ``nebula audit show``.

Queries read the file as written (the writer only appends, so a concurrent read sees a prefix of
complete lines plus at most one partial line, which is skipped). Verification is a separate,
deliberate step (``nebula audit verify``): a query answers "what does the log say", not "is it
intact".
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from nebula_common.audit.segments import segments

__all__ = ["DEFAULT_LIMIT", "MAX_LIMIT", "AuditFilter", "QueryResult", "query_log"]

DEFAULT_LIMIT = 1000
MAX_LIMIT = 10_000


@dataclass(frozen=True)
class AuditFilter:
    """Every non-empty field must match. ``event`` ending in ``.`` is a prefix (``link.``)."""

    account: str = ""
    job_id: str = ""
    event: str = ""
    since_unix: float = 0.0
    until_unix: float = 0.0

    def matches(self, record: dict[str, Any]) -> bool:
        if self.account and record.get("account") != self.account:
            return False
        if self.job_id and record.get("job_id") != self.job_id:
            return False
        event = str(record.get("event", ""))
        if self.event and not (
            event.startswith(self.event) if self.event.endswith(".") else event == self.event
        ):
            return False
        if self.since_unix or self.until_unix:
            try:
                moment = datetime.fromisoformat(str(record["ts"]).replace("Z", "+00:00")).timestamp()
            except (KeyError, ValueError):
                return False
            if self.since_unix and moment < self.since_unix:
                return False
            if self.until_unix and moment >= self.until_unix:
                return False
        return True


@dataclass(frozen=True)
class QueryResult:
    records: list[dict[str, Any]]
    truncated: bool
    total_records: int


def _records(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, "rb") as handle:
        for raw in handle:
            if not raw.endswith(b"\n"):
                return  # a record being written right now
            try:
                record = json.loads(raw)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield record


def _all_records(path: Path) -> Iterator[dict[str, Any]]:
    """The records of every segment of the log at ``path``, oldest first."""
    for segment in segments(path) or [path]:
        yield from _records(segment)


def query_log(path: Path, where: AuditFilter, limit: int = DEFAULT_LIMIT) -> QueryResult:
    """The oldest ``limit`` records of ``path`` (its rotated segments included) matching ``where``."""
    if limit < 1 or limit > MAX_LIMIT:
        raise ValueError(f"limit must be between 1 and {MAX_LIMIT}, got {limit}")
    found: list[dict[str, Any]] = []
    truncated = False
    total = 0
    for record in _all_records(Path(path)):
        total += 1
        if where.matches(record):
            if len(found) == limit:
                truncated = True
                continue
            found.append(record)
    return QueryResult(found, truncated, total)
