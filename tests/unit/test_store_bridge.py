"""A rank box's store (``runtime/store_bridge.py``): a real gloo group forms through it, and it holds the
box to its stage's keys.

Two box processes (plain interpreters here, with the bridge's socketpair as their only store) form a
gloo group and all-reduce through ``BridgedStore``; every key they made is under ``stage/<n>/`` of
the backing TCPStore. Requests a hostile box could send (not JSON, an unknown operation, a key too
long, a value too big, a wait that never ends) are refused or time out, and drop only that box's
connection.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch.distributed as dist

from services.trainer.runtime.store_bridge import MAX_KEY_CHARS, MAX_VALUE_BYTES, BridgedStore, StoreBridge

ROOT = Path(__file__).resolve().parents[2]
BOX = """
import datetime, sys, torch, torch.distributed as dist
from multiprocessing.connection import Connection
from services.trainer.runtime.store_bridge import BridgedStore
rank = int(sys.argv[2])
store = BridgedStore(Connection(int(sys.argv[1])))
dist.init_process_group("gloo", store=dist.PrefixStore("compute/", store), rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
t = torch.ones(3) * (rank + 1)
dist.all_reduce(t)
store.set(f"sum/{rank}", str(t.sum().item()))
dist.destroy_process_group()
"""


@pytest.fixture
def backing() -> Iterator[dist.TCPStore]:
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    yield store


def pair() -> tuple[Connection, socket.socket]:
    ours, theirs = socket.socketpair()
    return Connection(ours.detach()), theirs


def test_two_boxes_form_a_gloo_group_through_their_bridges_inside_their_stage_keys(
    backing: dist.TCPStore,
) -> None:
    stage = dist.PrefixStore("stage/7", backing)
    bridges, boxes = [], []
    for rank in range(2):
        conn, theirs = pair()
        bridges.append(StoreBridge(conn, stage))
        boxes.append(
            subprocess.Popen(
                [sys.executable, "-c", BOX, str(theirs.fileno()), str(rank)],
                pass_fds=[theirs.fileno()],
                cwd=ROOT,
                stderr=subprocess.PIPE,
            )
        )
        theirs.close()
    for box in boxes:
        _, err = box.communicate(timeout=120)
        assert box.returncode == 0, err.decode()[-2000:]
    for bridge in bridges:
        bridge.stop()
        assert bridge.refused == ""
    assert [backing.get(f"stage/7/sum/{rank}") for rank in range(2)] == [b"9.0", b"9.0"]
    assert not backing.check(["sum/0"]), "a box's key landed outside its stage"


def test_a_box_reads_and_counts_only_through_its_stage(backing: dist.TCPStore) -> None:
    backing.set("worker/0", "secret-ish")
    conn, theirs = pair()
    bridge = StoreBridge(conn, dist.PrefixStore("stage/3", backing))
    store = BridgedStore(Connection(theirs.detach()))
    store.set("a", b"x")
    assert store.add("n", 5) == 5 and store.add("n", -2) == 3
    assert store.compare_set("a", b"x", b"y") == b"y"
    assert store.check(["a", "n"]) and not store.check(["worker/0"])
    assert store.get("a") == b"y" and backing.get("stage/3/a") == b"y"
    assert store.delete_key("a") and not store.check(["a"])
    store.set_timeout(datetime.timedelta(milliseconds=200))
    with pytest.raises(dist.DistStoreError, match="timeout"):
        store.get("../worker/0")  # a key is a name in the stage, never a path out of it
    bridge.stop()


def test_a_wait_that_never_ends_times_out_and_stop_ends_a_wait_in_progress(backing: dist.TCPStore) -> None:
    conn, theirs = pair()
    bridge = StoreBridge(conn, dist.PrefixStore("stage/1", backing))
    store = BridgedStore(Connection(theirs.detach()))
    with pytest.raises(dist.DistStoreError, match="timeout"):
        store.wait(["never"], datetime.timedelta(milliseconds=100))
    bridge.stop()
    conn, theirs = pair()
    bridge = StoreBridge(conn, dist.PrefixStore("stage/1", backing))
    box = Connection(theirs.detach())
    box.send_bytes(json.dumps({"op": "wait", "keys": ["never"], "timeout_ms": 3_600_000}).encode())
    box.poll(0.3)  # the bridge is in its wait now
    bridge.stop(timeout=5.0)
    assert not bridge._thread.is_alive(), "a box's endless wait held the bridge past stop()"


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"not json"], "not JSON"),
        ([b"[1]"], "not a store operation"),
        ([json.dumps({"op": "exec", "key": "a"}).encode()], "not a store operation"),
        ([json.dumps({"op": "get", "key": "k" * (MAX_KEY_CHARS + 1), "timeout_ms": 1}).encode()], "a key"),
        ([json.dumps({"op": "wait", "keys": [], "timeout_ms": 1}).encode()], "needs 1 to"),
        ([json.dumps({"op": "wait", "keys": ["a"], "timeout_ms": -1}).encode()], "timeout_ms"),
        ([json.dumps({"op": "add", "key": "a", "amount": 1 << 63}).encode()], "amount"),
        ([json.dumps({"op": "add", "key": "a", "amount": True}).encode()], "amount"),
        ([b"[" * 60_000], "nested too deeply"),
        ([b"[" * 100_000], "longer than"),
    ],
)
def test_a_request_not_of_the_protocol_drops_the_box_and_names_why(
    backing: dist.TCPStore, frames: list[bytes], reason: str
) -> None:
    conn, theirs = pair()
    bridge = StoreBridge(conn, dist.PrefixStore("stage/2", backing))
    box = Connection(theirs.detach())
    for frame in frames:
        with contextlib.suppress(OSError):  # the bridge may hang up before a long frame is written
            box.send_bytes(frame)
    bridge._thread.join(10)
    assert not bridge._thread.is_alive() and reason in bridge.refused, bridge.refused
    with pytest.raises((EOFError, OSError)):
        box.recv_bytes()
    bridge.stop()


def test_a_value_over_the_bound_drops_the_box_and_stores_nothing(backing: dist.TCPStore) -> None:
    conn, theirs = pair()
    bridge = StoreBridge(conn, dist.PrefixStore("stage/4", backing))
    box = Connection(theirs.detach())
    box.send_bytes(json.dumps({"op": "set", "key": "big"}).encode())
    with contextlib.suppress(OSError):  # the bridge hangs up on reading the frame's length
        box.send_bytes(b"\0" * (MAX_VALUE_BYTES + 1))
    bridge._thread.join(10)
    assert not bridge._thread.is_alive() and "longer than" in bridge.refused
    assert not backing.check(["stage/4/big"])
    bridge.stop()
