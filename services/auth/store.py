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


class AccountExistsError(NebulaError):
    """An account with this username already exists in the cluster."""


@dataclass(frozen=True)
class AccountRecord:
    username: str
    password_hash: str
    role: str
    created_at: int
    disabled: bool


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
                "SELECT username, password_hash, role, created_at, disabled FROM accounts WHERE username = ?",
                (username,),
            ).fetchone()
        if row is None:
            return None
        return AccountRecord(
            username=row[0], password_hash=row[1], role=row[2], created_at=int(row[3]), disabled=bool(row[4])
        )

    def set_password_hash(self, username: str, password_hash: str) -> bool:
        """Replace a stored hash (rehash after a parameter upgrade); False when the account is gone."""
        with self._lock:
            cursor = self._conn.execute(
                "UPDATE accounts SET password_hash = ? WHERE username = ?", (password_hash, username)
            )
        return cursor.rowcount == 1

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
