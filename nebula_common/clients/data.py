"""Typed synchronous client of a cluster's data service (``nebula.v1.Data``).

Callers work with dataclasses and the exceptions below instead of protobuf and ``grpc.RpcError``.
Refusals keep their meaning: ``DatasetNotFoundError`` is what an account gets for another
account's dataset it holds no grant on (the service does not reveal whether it exists).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar, cast

import grpc

from nebula_common.durable import atomic_write
from nebula_common.errors import (
    AuthenticationError,
    InvalidRequestError,
    NebulaError,
    PermissionDeniedError,
)
from nebula_common.proto.nebula.v1 import data_pb2, data_pb2_grpc
from nebula_common.rpc import bearer_metadata
from nebula_common.rpc.internal_tls import internal_channel

_T = TypeVar("_T")
DEFAULT_TIMEOUT_SECONDS = 30.0
UPLOAD_CHUNK_BYTES = 1024 * 1024


class DatasetNotFoundError(NebulaError):
    """No such dataset visible to this account (NOT_FOUND): absent, or another account's without a grant."""


class DatasetExistsError(NebulaError):
    """The account already has a dataset of that name (ALREADY_EXISTS)."""


class DataServiceUnavailableError(NebulaError):
    """The data service could not be reached in time."""


_ERRORS: dict[grpc.StatusCode, type[NebulaError]] = {
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: DatasetNotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: DatasetExistsError,
    grpc.StatusCode.UNAVAILABLE: DataServiceUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DataServiceUnavailableError,
}


@dataclass(frozen=True)
class DatasetInfo:
    owner: str
    name: str
    records: int
    size_bytes: int
    sha256: str
    created_at: int

    @property
    def ref(self) -> str:
        """``owner/name``, the form the CLI and ``GrantedBatchSource`` accept."""
        return f"{self.owner}/{self.name}"

    @classmethod
    def from_proto(cls, reply: data_pb2.Dataset) -> DatasetInfo:
        return cls(reply.owner, reply.name, reply.records, reply.size_bytes, reply.sha256, reply.created_at)


@dataclass(frozen=True)
class GrantInfo:
    owner: str
    name: str
    grantee: str
    granted_at: int
    expires_at: int
    """0: until revoked."""

    @classmethod
    def from_proto(cls, reply: data_pb2.GrantInfo) -> GrantInfo:
        return cls(reply.owner, reply.name, reply.grantee, reply.granted_at, reply.expires_at)


def parse_dataset_ref(ref: str) -> tuple[str, str]:
    """``"owner/name"`` -> (owner, name); ``"name"`` -> ("", name), i.e. the caller's own."""
    owner, slash, name = ref.rpartition("/")
    if not name or (slash and not owner) or "/" in owner:
        raise InvalidRequestError(f"dataset {ref!r} must be NAME or OWNER/NAME")
    return owner, name


class DataClient:
    """Client of the data service at ``address`` acting with ``token`` (an account of that cluster).

    ``token`` may be a callable read at every call: a running stage's job token is renewed under it.
    """

    def __init__(
        self, address: str, token: str | Callable[[], str], *, timeout: float = DEFAULT_TIMEOUT_SECONDS
    ) -> None:
        if not token:
            raise AuthenticationError("a bearer token of this cluster is required")
        self._address = address
        self._timeout = timeout
        self._token = token
        self._channel = cast(grpc.Channel, internal_channel(address, service="data"))
        self._stub = data_pb2_grpc.DataStub(self._channel)

    @property
    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return bearer_metadata(self._token() if callable(self._token) else self._token)

    # ------------------------------------------------------------------ datasets
    def upload_bytes(self, name: str, chunks: Iterable[bytes]) -> DatasetInfo:
        """Create dataset ``name`` from JSON Lines bytes (any chunking; lines may span chunks)."""

        def requests() -> Iterator[data_pb2.UploadDatasetRequest]:
            yield data_pb2.UploadDatasetRequest(header=data_pb2.UploadDatasetHeader(name=name))
            for chunk in chunks:
                for start in range(0, len(chunk), UPLOAD_CHUNK_BYTES):
                    yield data_pb2.UploadDatasetRequest(chunk=chunk[start : start + UPLOAD_CHUNK_BYTES])

        reply = self._call(
            lambda: self._stub.UploadDataset(requests(), metadata=self._metadata, timeout=self._timeout)
        )
        return DatasetInfo.from_proto(reply)

    def upload_file(self, name: str, path: Path) -> DatasetInfo:
        """Create dataset ``name`` from a local JSON Lines file, streamed."""
        with open(path, "rb") as handle:
            return self.upload_bytes(name, iter(lambda: handle.read(UPLOAD_CHUNK_BYTES), b""))

    def upload_records(self, name: str, records: Iterable[Any]) -> DatasetInfo:
        """Create dataset ``name`` from Python values, one JSON line each."""
        lines = (json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in records)
        return self.upload_bytes(name, lines)

    def import_file(self, name: str, inbox_path: str) -> DatasetInfo:
        """Create dataset ``name`` from a file already in this account's inbox on the service's host."""
        request = data_pb2.ImportDatasetRequest(name=name, inbox_path=inbox_path)
        reply = self._call(
            lambda: self._stub.ImportDataset(request, metadata=self._metadata, timeout=self._timeout)
        )
        return DatasetInfo.from_proto(reply)

    def list(self) -> tuple[list[DatasetInfo], list[DatasetInfo]]:
        """(own datasets, datasets other accounts granted this one)."""
        reply = self._call(
            lambda: self._stub.ListDatasets(
                data_pb2.ListDatasetsRequest(), metadata=self._metadata, timeout=self._timeout
            )
        )
        return [DatasetInfo.from_proto(d) for d in reply.owned], [
            DatasetInfo.from_proto(d) for d in reply.granted
        ]

    def delete(self, dataset: str) -> None:
        ref = _ref(dataset)
        self._call(lambda: self._stub.DeleteDataset(ref, metadata=self._metadata, timeout=self._timeout))

    def download(self, dataset: str, destination: Path) -> int:
        """Write one's own dataset's JSON Lines to ``destination`` atomically; returns its size."""
        ref = _ref(dataset)

        def fetch() -> bytes:
            stream = self._stub.DownloadDataset(ref, metadata=self._metadata, timeout=self._timeout)
            return b"".join(chunk.data for chunk in stream)

        content = self._call(fetch)
        atomic_write(destination, content, mode=0o600)
        return len(content)

    # ------------------------------------------------------------------ grants
    def grant(self, name: str, grantee: str, expires_at: int = 0) -> GrantInfo:
        request = data_pb2.GrantRequest(name=name, grantee=grantee, expires_at=expires_at)
        reply = self._call(lambda: self._stub.Grant(request, metadata=self._metadata, timeout=self._timeout))
        return GrantInfo.from_proto(reply)

    def revoke(self, name: str, grantee: str) -> bool:
        """True if a grant was withdrawn, False if ``grantee`` held none."""
        request = data_pb2.RevokeRequest(name=name, grantee=grantee)
        reply = self._call(lambda: self._stub.Revoke(request, metadata=self._metadata, timeout=self._timeout))
        return bool(reply.revoked)

    def grants(self, dataset: str) -> list[GrantInfo]:
        ref = _ref(dataset)
        reply = self._call(lambda: self._stub.ListGrants(ref, metadata=self._metadata, timeout=self._timeout))
        return [GrantInfo.from_proto(g) for g in reply.grants]

    # ------------------------------------------------------------------ reading
    def read_batch_json(self, dataset: str, example_ids: Sequence[int]) -> list[str]:
        """Records ``example_ids`` of ``dataset`` (``owner/name`` or own ``name``) as JSON text."""
        request = data_pb2.ReadBatchRequest(dataset=_ref(dataset), example_ids=[int(i) for i in example_ids])
        reply = self._call(
            lambda: self._stub.ReadBatch(request, metadata=self._metadata, timeout=self._timeout)
        )
        return list(reply.records_json)

    def read_batch(self, dataset: str, example_ids: Sequence[int]) -> list[Any]:
        """Like :meth:`read_batch_json`, each record parsed."""
        return [json.loads(r) for r in self.read_batch_json(dataset, example_ids)]

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> DataClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _call(self, invoke: Callable[[], _T]) -> _T:
        try:
            return invoke()
        except grpc.RpcError as exc:
            raise _map_error(self._address, exc) from exc


def _ref(dataset: str) -> data_pb2.DatasetRef:
    owner, name = parse_dataset_ref(dataset)
    return data_pb2.DatasetRef(owner=owner, name=name)


def _map_error(address: str, exc: grpc.RpcError) -> NebulaError:
    if not isinstance(exc, grpc.Call):
        return NebulaError(f"data service at {address}: {exc}")
    code, details = exc.code(), exc.details() or ""
    error_type = _ERRORS.get(code)
    if error_type is None:
        return NebulaError(f"data service at {address} failed ({code.name}): {details}")
    if error_type is DataServiceUnavailableError:
        return DataServiceUnavailableError(f"data service at {address} unavailable: {details}")
    return error_type(details)
