"""The data service's on-disk store: namespaces, ingest validation, atomicity, grants, safe imports."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

from nebula_common.errors import InvalidRequestError
from nebula_common.proto.nebula.v1 import relay_pb2, tensor_pb2
from services.data.store import (
    DatasetExistsError,
    DatasetFormatError,
    DatasetNotFoundError,
    DatasetStore,
    DatasetTooLargeError,
)
from services.switch.route_state import RouteInUseError
from services.switch.routing import Router


def _lines(*records: object) -> list[bytes]:
    return [json.dumps(r).encode() + b"\n" for r in records]


@pytest.fixture()
def store(tmp_path: Path) -> DatasetStore:
    return DatasetStore(tmp_path, max_dataset_bytes=10_000)


def test_records_are_read_by_id_across_chunk_boundaries_without_a_trailing_newline(
    store: DatasetStore,
) -> None:
    content = b'{"a": 1}\n["x", 2]\n"three"\n{"a": 4}'
    chunks = [content[i : i + 3] for i in range(0, len(content), 3)]  # lines split mid-way
    info = store.create("alice", "ds", chunks)
    assert info.records == 4
    assert store.read("alice", "ds", [3, 0, 0]) == [b'{"a": 4}', b'{"a": 1}', b'{"a": 1}']
    with pytest.raises(InvalidRequestError, match="example id 4 is out of range"):
        store.read("alice", "ds", [4])


@pytest.mark.parametrize(
    ("content", "error", "message"),
    [
        (b'{"a": 1}\nnot json\n', DatasetFormatError, "line 2 is not valid JSON"),
        (b'{"a": 1}\n\n{"a": 2}\n', DatasetFormatError, "line 2 is empty"),
        (b"", DatasetFormatError, "has no records"),
        (b"1\n" * 6000, DatasetTooLargeError, "exceeds the limit of 10000 bytes"),
    ],
)
def test_bad_content_is_refused_naming_the_problem_and_leaves_nothing_behind(
    store: DatasetStore, content: bytes, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        store.create("alice", "bad", [content])
    assert store.get("alice", "bad") is None
    assert list((store.root / "accounts" / "alice" / "datasets").iterdir()) == []  # no staging left


def test_names_that_could_leave_a_namespace_are_refused(store: DatasetStore) -> None:
    for bad in ("..", ".hidden", "a/b", "", "A", "x" * 65):
        with pytest.raises(InvalidRequestError, match="must be 1-64 characters"):
            store.create("alice", bad, _lines(1))
    with pytest.raises(InvalidRequestError, match="account"):
        store.create("..", "ds", _lines(1))


def test_namespaces_are_separate_and_names_are_not_overwritten(store: DatasetStore) -> None:
    store.create("alice", "ds", _lines({"owner": "alice"}))
    store.create("bob", "ds", _lines({"owner": "bob"}))
    with pytest.raises(DatasetExistsError):
        store.create("alice", "ds", _lines({"owner": "mallory"}))
    assert store.read("alice", "ds", [0]) == [b'{"owner": "alice"}']
    assert store.read("bob", "ds", [0]) == [b'{"owner": "bob"}']
    assert [d.owner for d in store.list_owned("alice")] == ["alice"]


def test_grants_are_checked_against_the_file_each_time_and_end_with_revoke_expiry_or_delete(
    store: DatasetStore,
) -> None:
    store.create("alice", "ds", _lines(1, 2))
    assert not store.may_read("alice", "ds", "bob")
    store.grant("alice", "ds", "bob")
    assert store.may_read("alice", "ds", "bob")
    assert [d.name for d in store.list_granted_to("bob")] == ["ds"]
    # A second store on the same directory (another replica) sees the revocation at once.
    DatasetStore(store.root, max_dataset_bytes=10).revoke("alice", "ds", "bob")
    assert not store.may_read("alice", "ds", "bob")
    future = int(time.time()) + 100
    store.grant("alice", "ds", "carol", expires_at=future)
    assert store.may_read("alice", "ds", "carol")
    assert not store.may_read("alice", "ds", "carol", now=future + 1)
    with pytest.raises(InvalidRequestError, match="owner needs no grant"):
        store.grant("alice", "ds", "alice")
    with pytest.raises(InvalidRequestError, match="in the future"):
        store.grant("alice", "ds", "dave", expires_at=5)
    store.delete("alice", "ds")
    with pytest.raises(DatasetNotFoundError):
        store.grant("alice", "ds", "bob")
    assert store.list_granted_to("carol") == []


def test_imports_read_only_regular_files_inside_the_callers_inbox(
    store: DatasetStore, tmp_path: Path
) -> None:
    store.create("bob", "secret", _lines({"secret": True}))
    inbox = store.inbox("alice")
    (inbox / "sub").mkdir()
    (inbox / "sub" / "ok.jsonl").write_bytes(b"1\n2\n")
    assert store.import_from_inbox("alice", "ok", "sub/ok.jsonl").records == 2
    os.symlink(
        store.root / "accounts" / "bob" / "datasets" / "secret" / "records.jsonl", inbox / "link.jsonl"
    )
    os.symlink(store.root / "accounts" / "bob" / "datasets", inbox / "linkdir")
    for bad, why in [
        ("link.jsonl", "symlinks are refused"),
        ("linkdir/secret/records.jsonl", "symlinks are refused"),
        ("../../bob/datasets/secret/records.jsonl", "must not contain"),
        ("/etc/passwd", "relative to your inbox"),
        ("missing.jsonl", "no file"),
        ("sub", "not a regular file"),
    ]:
        with pytest.raises(InvalidRequestError, match=why):
            store.import_from_inbox("alice", "stolen", bad)
    assert store.get("alice", "stolen") is None


def test_the_switch_keeps_a_jobs_edges_for_the_account_that_first_attached() -> None:
    async def scenario() -> None:
        router = Router()
        route, attachment = router.attach(("job", "e"), owner="alice")
        router.end_stream(route, attachment, None)
        # Between two of alice's streams, another account cannot take over the job's edges.
        for edge in ("e", "other-edge"):
            with pytest.raises(RouteInUseError, match="not available to this account"):
                router.attach(("job", edge), owner="mallory")
        router.deliver(("job", "e"), relay_pb2.EdgeMessage(frame=tensor_pb2.TensorFrame()))
        route, _ = router.attach(("job", "e"), owner="alice")
        assert len(route.inbound) == 1

    asyncio.run(scenario())
