"""Reading an existing log back when its writer starts: where the chain ends, what is unsigned.

A writer continues the chain of the log it finds (one process owns a log); a signer of its own
process (``remote_signer``) must be sent the records it has not sealed yet. Both read only the
file's ends; verifying everything is ``nebula audit verify``'s job.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from nebula_common.audit.records import GENESIS_PREV, AuditError
from nebula_common.audit.seal_keeper import SealPosition

__all__ = ["lines_after", "read_head", "unsigned_lines"]


def read_head(path: Path) -> tuple[int, str, str]:
    """(last seq, last hash, log id) of the log at ``path``; (0, genesis, "") for an empty file.

    Only the first and last lines are read; a torn or unparseable last line stops the service
    rather than chaining new records onto something nobody can check.
    """
    with open(path, "rb") as handle:
        first = handle.readline()
        if not first:
            return 0, GENESIS_PREV, ""
        handle.seek(0, os.SEEK_END)
        size = handle.tell()
        handle.seek(max(0, size - (1 << 20)))
        tail = handle.read().splitlines()
    try:
        genesis = json.loads(first)
        last = json.loads(tail[-1])
        log_id = str(genesis["details"]["log_id"])
        return int(last["seq"]), str(last["hash"]), log_id
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise AuditError(
            f"audit log {path} ends in an unreadable record ({exc!r}); "
            f"run `nebula audit verify {path}` and move the file aside before restarting"
        ) from exc


def unsigned_lines(path: Path, known: SealPosition, seq: int, head: str, log_id: str) -> list[bytes]:
    """The lines of ``path`` after the signer's last signed head ``known``.

    A rotation seals before it moves the file, so what the signer has not signed is in the current
    file. A signer that has signed nothing yet starts from this log's last record (a log sealed by a
    key of its own until now). A log that does not reach the signer's head, or is another log,
    stops the service here with the reason, rather than at its first seal.
    """
    if not known.log_id:
        return lines_after(path, seq - 1) if seq else []
    if known.log_id != log_id or known.count > seq:
        raise AuditError(
            f"audit log {path} is log {log_id or '(new)'} with {seq} records, but its "
            f"signer sealed log {known.log_id} up to record {known.count}: the log was cut short or "
            f"replaced (run `nebula audit verify {path}`)"
        )
    if known.count == seq:
        if head != known.head:
            raise AuditError(f"audit log {path} ends at record {seq}, not at the sealed head")
        return []
    lines = lines_after(path, known.count)
    first = json.loads(lines[0]) if lines else {}
    if first.get("seq") != known.count + 1 or first.get("prev") != known.head:
        raise AuditError(
            f"audit log {path} no longer holds the records after {known.count} that its signer "
            f"sealed (run `nebula audit verify {path}`)"
        )
    return lines


def lines_after(path: Path, count: int) -> list[bytes]:
    """The file's record lines with ``seq`` above ``count``, oldest first (the tail read first)."""
    with open(path, "rb") as handle:
        size = handle.seek(0, os.SEEK_END)
        for start in (max(0, size - (4 << 20)), 0):
            handle.seek(start)
            lines = handle.read().split(b"\n")
            if start:
                lines = lines[1:]  # the first may be a line's end
            found = [line for line in lines if line and int(json.loads(line)["seq"]) > count]
            if not start or len(found) < len(lines) - 1:  # the tail reached back far enough
                return found
    return found
