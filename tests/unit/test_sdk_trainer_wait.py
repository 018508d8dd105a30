"""The SDK waits for a trainer that is being restarted instead of failing "connection refused".

A submit or cancel issued while a supervisor restarts the trainer (seconds) must go through once it
listens again; a trainer that never comes back fails after ``trainer_wait_s`` naming it.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from nebula_common.clients.endpoints import ClusterEndpoints
from nebula_common.errors import NebulaError
from nebula_common.sdk.client import ClusterSession

pytestmark = pytest.mark.timeout(60)


def endpoints(trainer: str) -> ClusterEndpoints:
    return ClusterEndpoints(cluster_id="a", auth="127.0.0.1:1", trainer=trainer, switch="127.0.0.1:1")


def test_a_trainer_that_never_listens_fails_naming_it_after_the_wait() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")  # bound, never started: connections are refused
    session = ClusterSession(endpoints(f"127.0.0.1:{port}"), "token", "alice", trainer_wait_s=0.5)
    started = time.monotonic()
    with pytest.raises(NebulaError) as refused:
        session.cancel("job-1")
    assert time.monotonic() - started >= 0.45
    message = str(refused.value)
    assert f"cluster a's trainer at 127.0.0.1:{port} accepted no connection for 0.5 s" in message
    assert "cancelling job job-1 on cluster a" in message
    session.close()
    server.stop(None)


def test_a_call_made_while_the_trainer_restarts_reaches_it_once_it_listens() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = server.add_insecure_port("127.0.0.1:0")
    session = ClusterSession(endpoints(f"127.0.0.1:{port}"), "token", "alice", trainer_wait_s=30.0)
    listening = threading.Timer(1.0, server.start)  # the "restarted" trainer comes up a second later
    listening.start()
    started = time.monotonic()
    try:
        # The server implements no service: reaching it at all answers UNIMPLEMENTED.
        with pytest.raises((grpc.RpcError, NebulaError)) as answered:
            session.cancel("job-1")
        assert time.monotonic() - started >= 0.9
        assert "accepted no connection" not in str(answered.value)
        code = answered.value.code() if isinstance(answered.value, grpc.RpcError) else None
        assert code in (grpc.StatusCode.UNIMPLEMENTED, None), code
        if code is None:
            assert "unimplemented" in str(answered.value).lower() or "method" in str(answered.value).lower()
    finally:
        listening.join()
        session.close()
        server.stop(None)


def test_waiting_leaves_no_thread_behind_on_the_channel() -> None:
    # grpc.channel_ready_future polls connectivity from a thread of its own that outlives a timed-out
    # wait and, once the session closes its channel, dies logging "Channel closed!". The wait is a
    # health call with a deadline instead: nothing of it remains once it returned or failed.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")  # bound, never started
    before = set(threading.enumerate())
    session = ClusterSession(endpoints(f"127.0.0.1:{port}"), "token", "alice", trainer_wait_s=0.3)
    try:
        with pytest.raises(NebulaError, match="accepted no connection"):
            session.cancel("job-1")
        left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
        assert left == [], f"threads left by the trainer wait: {left}"
    finally:
        session.close()
        server.stop(None)


def test_a_negative_wait_is_refused() -> None:
    with pytest.raises(ValueError, match="trainer_wait_s must be >= 0"):
        ClusterSession(endpoints("127.0.0.1:1"), "token", "alice", trainer_wait_s=-1)
