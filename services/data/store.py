"""Datasets on disk, one namespace per account, and the grants that let others read them.

Layout under the data service's data dir::

    accounts/<owner>/inbox/                  files the owner may import (put there by the owner)
    accounts/<owner>/datasets/<name>/records.jsonl   the records, one JSON value per line
                                     index.u64       n+1 little-endian byte offsets into records.jsonl
                                     meta.json       {"owner", "name", "records", "size_bytes", "sha256", ...}
                                     grants.json     {"<grantee>": {"granted_at": t, "expires_at": t|0}}

Why this shape: the owner is part of every path, so no lookup by another account's name can land
in a different namespace; a dataset appears by one ``rename`` of a complete directory (a crash
never leaves a half dataset that looks whole); the offset index makes ``read`` a few ``pread`` calls
whatever the dataset size; and grants are read from disk on every ``read``, so a revocation (or a
second replica's revocation) applies to the very next batch without any cache to invalidate.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import threading
import time
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from nebula_common.durable import atomic_write, fsync_dir
from nebula_common.errors import InvalidRequestError, NebulaError

NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
"""Dataset and account names as path components: no separators, no leading dot (so never ``..``)."""

RECORDS_FILE = "records.jsonl"
INDEX_FILE = "index.u64"
META_FILE = "meta.json"
GRANTS_FILE = "grants.json"
MAX_RECORD_BYTES = 16 * 1024 * 1024
"""One JSON record may not exceed this; it bounds the memory of a read and of a line being parsed."""


class DatasetNotFoundError(NebulaError):
    """No dataset of that name the caller may see (also said when it exists but is not the caller's)."""


class DatasetExistsError(NebulaError):
    """The owner already has a dataset of that name."""


class DatasetFormatError(InvalidRequestError):
    """Uploaded or imported content is not JSON Lines; the message names the line."""


class DatasetTooLargeError(InvalidRequestError):
    """Content exceeds the service's per-dataset size limit."""


def check_name(value: str, what: str) -> str:
    """``value`` if it is a safe path component, else an error naming ``what`` and the rule."""
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
        raise InvalidRequestError(
            f"{what} {value!r} must be 1-64 characters of [a-z0-9._-] and must not start with '.', '_' or '-'"
        )
    return value


@dataclass(frozen=True)
class DatasetInfo:
    owner: str
    name: str
    records: int
    size_bytes: int
    sha256: str
    created_at: int


@dataclass(frozen=True)
class GrantRecord:
    owner: str
    name: str
    grantee: str
    granted_at: int
    expires_at: int
    """0: until revoked."""

    def active(self, now: float) -> bool:
        return self.expires_at == 0 or now < self.expires_at


class DatasetStore:
    """All datasets of one cluster's data service. Thread-safe (servicers call it from worker threads)."""

    def __init__(self, root: Path, *, max_dataset_bytes: int) -> None:
        if max_dataset_bytes < 1:
            raise ValueError(f"max_dataset_bytes must be positive, got {max_dataset_bytes}")
        self.root = Path(root)
        self.max_dataset_bytes = max_dataset_bytes
        (self.root / "accounts").mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock = threading.Lock()  # serialises grant-file read-modify-write and create/delete

    # ------------------------------------------------------------------ paths
    def account_dir(self, owner: str) -> Path:
        return self.root / "accounts" / check_name(owner, "account")

    def inbox(self, owner: str) -> Path:
        """The owner's import directory (created on demand, so operators can see where to put files)."""
        path = self.account_dir(owner) / "inbox"
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return path

    def _datasets_dir(self, owner: str) -> Path:
        return self.account_dir(owner) / "datasets"

    def _dataset_dir(self, owner: str, name: str) -> Path:
        return self._datasets_dir(owner) / check_name(name, "dataset name")

    # ------------------------------------------------------------------ create
    def create(self, owner: str, name: str, chunks: Iterable[bytes]) -> DatasetInfo:
        """Ingest JSON Lines from ``chunks`` as ``owner``'s dataset ``name``; all-or-nothing."""
        final = self._dataset_dir(owner, name)
        parent = final.parent
        parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if final.exists():
            raise DatasetExistsError(f"dataset {owner}/{name} already exists")
        staging = parent / f".incoming-{secrets.token_hex(8)}"
        staging.mkdir(mode=0o700)
        try:
            info = self._ingest(staging, owner, name, chunks)
            with self._lock:
                try:
                    os.rename(staging, final)  # fails if the name appeared meanwhile: no overwrite
                except OSError as exc:
                    if final.exists():
                        raise DatasetExistsError(f"dataset {owner}/{name} already exists") from exc
                    raise
            fsync_dir(parent)
            return info
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _ingest(self, staging: Path, owner: str, name: str, chunks: Iterable[bytes]) -> DatasetInfo:
        digest = hashlib.sha256()
        offsets = array("Q", [0])
        size = 0
        pending = b""
        line_no = 0

        def take_line(line: bytes) -> None:
            nonlocal line_no
            line_no += 1
            _check_line(line, line_no)
            offsets.append(offsets[-1] + len(line) + 1)

        with open(staging / RECORDS_FILE, "xb") as out:
            for chunk in chunks:
                size += len(chunk)
                if size > self.max_dataset_bytes:
                    raise DatasetTooLargeError(
                        f"dataset {owner}/{name} exceeds the limit of {self.max_dataset_bytes} bytes"
                    )
                digest.update(chunk)
                out.write(chunk)
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    take_line(line)
                if len(pending) > MAX_RECORD_BYTES:
                    raise DatasetFormatError(f"line {line_no + 1} exceeds {MAX_RECORD_BYTES} bytes")
            if pending:
                # A last line without its newline: store it with one so every record ends alike.
                take_line(pending)
                out.write(b"\n")
                digest.update(b"\n")
                size += 1
            if line_no == 0:
                raise DatasetFormatError(f"dataset {owner}/{name} has no records")
            out.flush()
            os.fsync(out.fileno())
        with open(staging / INDEX_FILE, "xb") as index:
            index.write(_little_endian(offsets))
            index.flush()
            os.fsync(index.fileno())
        info = DatasetInfo(owner, name, line_no, size, digest.hexdigest(), int(time.time()))
        atomic_write(staging / META_FILE, json.dumps(info.__dict__, sort_keys=True).encode(), mode=0o600)
        atomic_write(staging / GRANTS_FILE, b"{}", mode=0o600)
        return info

    def import_from_inbox(self, owner: str, name: str, inbox_path: str) -> DatasetInfo:
        """Create a dataset from a file in ``owner``'s own inbox; nothing outside it is reachable."""
        with self._open_inbox_file(owner, inbox_path) as handle:
            return self.create(owner, name, iter(lambda: handle.read(1 << 20), b""))

    @contextlib.contextmanager
    def _open_inbox_file(self, owner: str, inbox_path: str) -> Iterator[Any]:
        if not inbox_path:
            raise InvalidRequestError("inbox_path is required")
        relative = PurePosixPath(inbox_path)
        if relative.is_absolute() or "\\" in inbox_path:
            raise InvalidRequestError(f"inbox_path {inbox_path!r} must be relative to your inbox")
        if any(part in ("", ".", "..") or part.startswith(".") for part in relative.parts):
            raise InvalidRequestError(f"inbox_path {inbox_path!r} must not contain '.', '..' or hidden names")
        inbox = self.inbox(owner)
        # Walk component by component without following symlinks: a link planted in the inbox must
        # not turn an import into a read of another namespace or of the service's own secrets.
        fd = os.open(inbox, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for index, part in enumerate(relative.parts):
                last = index == len(relative.parts) - 1
                flags = os.O_RDONLY | os.O_NOFOLLOW | (0 if last else os.O_DIRECTORY)
                try:
                    child = os.open(part, flags, dir_fd=fd)
                except FileNotFoundError:
                    raise InvalidRequestError(f"no file {inbox_path!r} in your inbox") from None
                except OSError as exc:
                    raise InvalidRequestError(
                        f"inbox_path {inbox_path!r} is not a plain file or directory in your inbox "
                        f"(symlinks are refused): {exc.strerror}"
                    ) from None
                os.close(fd)
                fd = child
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise InvalidRequestError(f"inbox_path {inbox_path!r} is not a regular file")
            handle = os.fdopen(fd, "rb")
            fd = -1
        finally:
            if fd >= 0:
                os.close(fd)
        with handle:
            yield handle

    # ------------------------------------------------------------------ read metadata
    def get(self, owner: str, name: str) -> DatasetInfo | None:
        meta = self._dataset_dir(owner, name) / META_FILE
        try:
            data = json.loads(meta.read_text())
        except FileNotFoundError:
            return None
        return DatasetInfo(**data)

    def require(self, owner: str, name: str) -> DatasetInfo:
        info = self.get(owner, name)
        if info is None:
            raise DatasetNotFoundError(f"no dataset {owner}/{name} visible to this account")
        return info

    def list_owned(self, owner: str) -> list[DatasetInfo]:
        directory = self._datasets_dir(owner)
        if not directory.is_dir():
            return []
        found = (
            self.get(owner, p.name) for p in sorted(directory.iterdir()) if NAME_PATTERN.fullmatch(p.name)
        )
        return [info for info in found if info is not None]

    def list_granted_to(self, grantee: str, now: float | None = None) -> list[DatasetInfo]:
        """Datasets of other accounts with an active grant for ``grantee`` (a scan: few tenants)."""
        check_name(grantee, "account")
        moment = time.time() if now is None else now
        result = []
        for account in sorted((self.root / "accounts").iterdir()):
            if account.name == grantee or not NAME_PATTERN.fullmatch(account.name):
                continue
            for info in self.list_owned(account.name):
                grant = self.grants(info.owner, info.name).get(grantee)
                if grant is not None and grant.active(moment):
                    result.append(info)
        return result

    # ------------------------------------------------------------------ grants
    def grants(self, owner: str, name: str) -> dict[str, GrantRecord]:
        path = self._dataset_dir(owner, name) / GRANTS_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        return {
            grantee: GrantRecord(owner, name, grantee, int(g["granted_at"]), int(g["expires_at"]))
            for grantee, g in data.items()
        }

    def _write_grants(self, owner: str, name: str, grants: dict[str, GrantRecord]) -> None:
        body = {g.grantee: {"granted_at": g.granted_at, "expires_at": g.expires_at} for g in grants.values()}
        atomic_write(
            self._dataset_dir(owner, name) / GRANTS_FILE,
            json.dumps(body, sort_keys=True).encode(),
            mode=0o600,
        )

    def grant(self, owner: str, name: str, grantee: str, expires_at: int = 0) -> GrantRecord:
        check_name(grantee, "grantee")
        if grantee == owner:
            raise InvalidRequestError("a dataset's owner needs no grant on it")
        if expires_at < 0 or (expires_at and expires_at <= time.time()):
            raise InvalidRequestError(f"expires_at {expires_at} must be 0 (until revoked) or in the future")
        with self._lock:
            self.require(owner, name)
            grants = self.grants(owner, name)
            record = GrantRecord(owner, name, grantee, int(time.time()), expires_at)
            grants[grantee] = record
            self._write_grants(owner, name, grants)
        return record

    def revoke(self, owner: str, name: str, grantee: str) -> bool:
        check_name(grantee, "grantee")
        with self._lock:
            self.require(owner, name)
            grants = self.grants(owner, name)
            if grants.pop(grantee, None) is None:
                return False
            self._write_grants(owner, name, grants)
        return True

    def may_read(self, owner: str, name: str, reader: str, now: float | None = None) -> bool:
        """The owner always; anyone else only with an active grant, checked against the file now."""
        if reader == owner:
            return True
        grant = self.grants(owner, name).get(reader)
        return grant is not None and grant.active(time.time() if now is None else now)

    # ------------------------------------------------------------------ content
    def read(self, owner: str, name: str, ids: Iterable[int]) -> list[bytes]:
        """Records ``ids`` (each a JSON document without its newline), in the order asked."""
        directory = self._dataset_dir(owner, name)
        info = self.require(owner, name)
        wanted = list(ids)
        bad = [i for i in wanted if i >= info.records]
        if bad:
            raise InvalidRequestError(
                f"example id {bad[0]} is out of range: dataset {owner}/{name} has {info.records} records"
            )
        try:
            index_fd = os.open(directory / INDEX_FILE, os.O_RDONLY)
            records_fd = os.open(directory / RECORDS_FILE, os.O_RDONLY)
        except FileNotFoundError:
            raise DatasetNotFoundError(f"no dataset {owner}/{name} visible to this account") from None
        try:
            out = []
            for example in wanted:
                start, end = _unpack_pair(os.pread(index_fd, 16, example * 8))
                out.append(os.pread(records_fd, end - start - 1, start))
            return out
        finally:
            os.close(index_fd)
            os.close(records_fd)

    def iter_content(self, owner: str, name: str, chunk_bytes: int = 1 << 20) -> Iterator[bytes]:
        """The records file in chunks (for the owner's download; opened before the first yield)."""
        self.require(owner, name)
        handle = open(self._dataset_dir(owner, name) / RECORDS_FILE, "rb")  # noqa: SIM115 - closed below
        try:
            while chunk := handle.read(chunk_bytes):
                yield chunk
        finally:
            handle.close()

    def delete(self, owner: str, name: str) -> None:
        """Make the dataset (and its grants) disappear at once, then free the space."""
        directory = self._dataset_dir(owner, name)
        trash = directory.parent / f".deleted-{secrets.token_hex(8)}"
        with self._lock:
            self.require(owner, name)
            os.rename(directory, trash)
        fsync_dir(directory.parent)
        shutil.rmtree(trash, ignore_errors=True)


def _check_line(line: bytes, line_no: int) -> None:
    if len(line) > MAX_RECORD_BYTES:
        raise DatasetFormatError(f"line {line_no} exceeds {MAX_RECORD_BYTES} bytes")
    if not line.strip():
        raise DatasetFormatError(f"line {line_no} is empty; every line must hold one JSON value")
    try:
        json.loads(line)
    except (UnicodeDecodeError, ValueError) as exc:
        raise DatasetFormatError(f"line {line_no} is not valid JSON: {exc}") from None


def _little_endian(values: array) -> bytes:
    if array("H", [1]).tobytes() != b"\x01\x00":
        values = array("Q", values)
        values.byteswap()
    return values.tobytes()


def _unpack_pair(data: bytes) -> tuple[int, int]:
    if len(data) != 16:
        raise NebulaError("dataset index is truncated")
    return int.from_bytes(data[:8], "little"), int.from_bytes(data[8:], "little")
