"""Accounts of one cluster in a local SQLite file.

One auth replica per cluster owns the file, so SQLite is enough: WAL mode keeps
reads from blocking behind writes, and a single connection behind a lock keeps
the aio server correct when calls arrive through ``asyncio.to_thread``.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from nebula_common.errors import NebulaError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS accounts (
    username      TEXT PRIMARY KEY,
    password_hash TEXT NOT NULL,
    role          TEXT NOT NULL,
    created_at    INTEGER NOT NULL,
    disabled      INTEGER NOT NULL DEFAULT 0
)
"""
# Columns added after the first release; added in place to databases that predate them.
_MIGRATIONS = {
    "failed_logins": "ALTER TABLE accounts ADD COLUMN failed_logins INTEGER NOT NULL DEFAULT 0",
    "locked_until": "ALTER TABLE accounts ADD COLUMN locked_until INTEGER NOT NULL DEFAULT 0",
}
_COLUMNS = "username, password_hash, role, created_at, disabled, failed_logins, locked_until"
# Token revocations: tokens of ``username`` issued before ``not_before_ms`` are refused by every
# verifier of the cluster. ``revocation_epoch`` is a single counter that only ever grows, so a
# verifier can tell a newer revocation list from an older one (or from a rolled-back database).
_REVOCATION_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS token_revocations ("
    " username TEXT PRIMARY KEY, not_before_ms INTEGER NOT NULL, reason TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS revocation_epoch (id INTEGER PRIMARY KEY CHECK (id = 1),"
    " epoch INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO revocation_epoch (id, epoch) VALUES (1, 0)",
)


class AccountExistsError(NebulaError):
    """An account with this username already exists in the cluster."""


@dataclass(frozen=True)
class AccountRecord:
    username: str
    password_hash: str
    role: str
    created_at: int
    disabled: bool
    failed_logins: int = 0
    locked_until: int = 0
    """Seconds since the epoch until which logins are refused; 0 when not locked."""

    def locked(self, now: float | None = None) -> bool:
        return self.locked_until > (time.time() if now is None else now)


@dataclass(frozen=True)
class TokenRevocationRecord:
    """Tokens of ``username`` issued before ``not_before_ms`` (ms since the epoch) are refused."""

    username: str
    not_before_ms: int
    reason: str


class AccountStore:
    """CRUD over the ``accounts`` table; every method is blocking and thread-safe."""

    def __init__(self, path: Path) -> None:
        self._path = Path(path)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        # Create the file ourselves so it is 0600 from the first byte; SQLite
        # gives its -wal/-shm side files the same mode as the database.
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        os.close(fd)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(self._path, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA busy_timeout = 5000")
        self._conn.execute("PRAGMA journal_mode = WAL")
        self._conn.execute(_SCHEMA)
        present = {row[1] for row in self._conn.execute("PRAGMA table_info(accounts)")}
        for column, statement in _MIGRATIONS.items():
            if column not in present:
                self._conn.execute(statement)
        for statement in _REVOCATION_SCHEMA:
            self._conn.execute(statement)

    @property
    def path(self) -> Path:
        return self._path

    def create(self, username: str, password_hash: str, role: str) -> AccountRecord:
        """Insert a new enabled account; raises AccountExistsError when the name is taken."""
        record = AccountRecord(
            username=username,
            password_hash=password_hash,
            role=role,
            created_at=int(time.time()),
            disabled=False,
        )
        with self._lock:
            try:
                self._conn.execute(
                    "INSERT INTO accounts (username, password_hash, role, created_at, disabled)"
                    " VALUES (?, ?, ?, ?, 0)",
                    (record.username, record.password_hash, record.role, record.created_at),
                )
            except sqlite3.IntegrityError as exc:
                if exc.sqlite_errorname in ("SQLITE_CONSTRAINT_PRIMARYKEY", "SQLITE_CONSTRAINT_UNIQUE"):
                    raise AccountExistsError(f"account {username!r} already exists") from exc
                raise
        return record

    def get(self, username: str) -> AccountRecord | None:
        with self._lock:
            row = self._conn.execute(
                f"SELECT {_COLUMNS} FROM accounts WHERE username = ?", (username,)
            ).fetchone()
        return None if row is None else _record(row)

    def list(self) -> list[AccountRecord]:
        with self._lock:
            rows = self._conn.execute(f"SELECT {_COLUMNS} FROM accounts ORDER BY username").fetchall()
        return [_record(row) for row in rows]

    def set_disabled(self, username: str, disabled: bool) -> bool:
        """Disable or enable; enabling also clears a lockout. False when the account does not exist."""
        with self._lock:
            cursor = self._conn.execute(
                "UPDATE accounts SET disabled = ?, failed_logins = CASE WHEN ? THEN failed_logins ELSE 0 END,"
                " locked_until = CASE WHEN ? THEN locked_until ELSE 0 END WHERE username = ?",
                (int(disabled), int(disabled), int(disabled), username),
            )
        return cursor.rowcount == 1

    def delete(self, username: str) -> bool:
        with self._lock:
            cursor = self._conn.execute("DELETE FROM accounts WHERE username = ?", (username,))
        return cursor.rowcount == 1

    def count_admins(self) -> int:
        """Enabled admins: the last one must never be disabled or deleted (nobody could fix that)."""
        with self._lock:
            (total,) = self._conn.execute(
                "SELECT COUNT(*) FROM accounts WHERE role = 'admin' AND disabled = 0"
            ).fetchone()
        return int(total)

    def record_failure(
        self, username: str, *, max_failures: int, lockout_seconds: int
    ) -> AccountRecord | None:
        """Count a failed login in one statement; lock the account when the count reaches the limit."""
        now = int(time.time())
        with self._lock:
            self._conn.execute(
                "UPDATE accounts SET failed_logins = failed_logins + 1,"
                " locked_until = CASE WHEN failed_logins + 1 >= ? THEN ? ELSE locked_until END"
                " WHERE username = ?",
                (max_failures, now + lockout_seconds, username),
            )
            row = self._conn.execute(
                f"SELECT {_COLUMNS} FROM accounts WHERE username = ?", (username,)
            ).fetchone()
        return None if row is None else _record(row)

    def record_success(self, username: str) -> None:
        with self._lock:
            self._conn.execute(
                "UPDATE accounts SET failed_logins = 0, locked_until = 0 WHERE username = ?", (username,)
            )

    def set_password_hash(self, username: str, password_hash: str) -> bool:
        """Replace a stored hash (rehash after a parameter upgrade); False when the account is gone."""
        with self._lock:
            cursor = self._conn.execute(
                "UPDATE accounts SET password_hash = ? WHERE username = ?", (password_hash, username)
            )
        return cursor.rowcount == 1

    def revoke_tokens(self, username: str, reason: str, *, now: float | None = None) -> int:
        """Refuse every token of ``username`` issued until now; returns the new revocation epoch.

        One transaction, so a verifier never sees the new epoch without the entry. A later
        revocation of the same account replaces the earlier one (its moment is later).
        """
        moment_ms = int((time.time() if now is None else now) * 1000)
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.execute(
                    "INSERT INTO token_revocations (username, not_before_ms, reason) VALUES (?, ?, ?)"
                    " ON CONFLICT(username) DO UPDATE SET"
                    " not_before_ms = MAX(not_before_ms, excluded.not_before_ms), reason = excluded.reason",
                    (username, moment_ms, reason),
                )
                self._conn.execute("UPDATE revocation_epoch SET epoch = epoch + 1 WHERE id = 1")
                (epoch,) = self._conn.execute("SELECT epoch FROM revocation_epoch WHERE id = 1").fetchone()
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
        return int(epoch)

    def revocations(
        self, *, horizon_s: float, now: float | None = None
    ) -> tuple[int, list[TokenRevocationRecord]]:
        """The epoch and every revocation younger than ``horizon_s``; older ones are deleted.

        A revocation older than a token lifetime (plus leeway) covers only expired tokens, so
        dropping it changes nothing for verifiers and keeps the published list bounded. Dropping
        does not bump the epoch: the set of refused (unexpired) tokens is unchanged.
        """
        cutoff_ms = int(((time.time() if now is None else now) - horizon_s) * 1000)
        with self._lock:
            self._conn.execute("DELETE FROM token_revocations WHERE not_before_ms < ?", (cutoff_ms,))
            (epoch,) = self._conn.execute("SELECT epoch FROM revocation_epoch WHERE id = 1").fetchone()
            rows = self._conn.execute(
                "SELECT username, not_before_ms, reason FROM token_revocations ORDER BY username"
            ).fetchall()
        return int(epoch), [TokenRevocationRecord(str(u), int(n), str(r)) for u, n, r in rows]

    def count(self) -> int:
        with self._lock:
            (total,) = self._conn.execute("SELECT COUNT(*) FROM accounts").fetchone()
        return int(total)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> AccountStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _record(row: tuple[object, ...]) -> AccountRecord:
    return AccountRecord(
        username=str(row[0]),
        password_hash=str(row[1]),
        role=str(row[2]),
        created_at=int(row[3]),  # type: ignore[call-overload]
        disabled=bool(row[4]),
        failed_logins=int(row[5]),  # type: ignore[call-overload]
        locked_until=int(row[6]),  # type: ignore[call-overload]
    )
