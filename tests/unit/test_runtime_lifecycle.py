"""The stage lifecycle: how a stage's body ending (or being cancelled) becomes one terminal status.

No processes and no switch: each body here blocks or fails the way a training loop does, on a
real thread, and the abort hook is what the runtime attaches for its edge (a callable taking
the reason), here one that wakes the body the way ``EdgeConnection.abort`` wakes a receive.
"""

from __future__ import annotations

import queue
import threading

import pytest

from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer.edge import EdgeClosedError
from services.trainer.runtime.lifecycle import PEER_CANCELLED, StageLifecycle
from services.trainer.status import TERMINAL_STATES

pytestmark = pytest.mark.timeout(30)


class BlockingReceive:
    """A receive that blocks until a tensor or an abort arrives; abort wakes it with EdgeClosedError."""

    def __init__(self) -> None:
        self.aborts: list[str] = []
        self.waiting = threading.Event()
        self._items: queue.Queue[tuple[str, str]] = queue.Queue()

    def abort(self, reason: str) -> None:
        self.aborts.append(reason)
        self._items.put(("closed", reason))

    def receive(self) -> str:
        self.waiting.set()
        kind, value = self._items.get(timeout=20)
        if kind == "closed":
            raise EdgeClosedError(value)
        return value


def finish(lifecycle: StageLifecycle) -> trainer_pb2.StageStatus:
    lifecycle.join(20)
    assert not lifecycle.is_alive(), "the stage thread did not end"
    final = lifecycle.board.latest()
    assert final.state in TERMINAL_STATES
    return final


def test_a_body_that_returns_succeeds_and_cleanup_runs_after_the_terminal_state() -> None:
    seen_at_cleanup: list[int] = []
    holder: dict[str, StageLifecycle] = {}

    def body() -> None:
        holder["lifecycle"].board.update(state=trainer_pb2.STAGE_STATE_RUNNING, steps_done=1)

    lifecycle = StageLifecycle(
        "job-1",
        "encoder",
        body,
        cleanup=lambda: seen_at_cleanup.append(holder["lifecycle"].board.latest().state),
    )
    holder["lifecycle"] = lifecycle
    lifecycle.start()
    final = finish(lifecycle)
    assert final.state == trainer_pb2.STAGE_STATE_SUCCEEDED and final.message == ""
    assert (final.job_id, final.stage, final.steps_done) == ("job-1", "encoder", 1)
    assert seen_at_cleanup == [trainer_pb2.STAGE_STATE_SUCCEEDED]


def test_cancel_wakes_a_body_blocked_on_the_other_cluster() -> None:
    edge = BlockingReceive()
    holder: dict[str, StageLifecycle] = {}

    def body() -> None:
        holder["lifecycle"].attach_abort(edge.abort)
        edge.receive()  # the peer never sends: only cancel() can end this
        raise AssertionError("unreachable: the receive must raise")

    lifecycle = holder["lifecycle"] = StageLifecycle("job-2", "decoder", body)
    lifecycle.start()
    assert edge.waiting.wait(10)
    lifecycle.cancel()
    final = finish(lifecycle)
    assert final.state == trainer_pb2.STAGE_STATE_CANCELLED and final.message == "cancelled"
    assert edge.aborts == ["cancelled"]  # the peer is told once, with the reason
    assert lifecycle.cancelled


def test_a_cancel_before_the_edge_opens_is_honoured_when_it_opens() -> None:
    edge = BlockingReceive()
    holder: dict[str, StageLifecycle] = {}
    building, cancelled = threading.Event(), threading.Event()

    def body() -> None:
        building.set()
        assert cancelled.wait(10)  # the stage is still building when cancel() comes
        holder["lifecycle"].attach_abort(edge.abort)
        raise AssertionError("unreachable: attach_abort must raise StageCancelled")

    lifecycle = holder["lifecycle"] = StageLifecycle("job-3", "encoder", body)
    lifecycle.start()
    assert building.wait(10)
    lifecycle.cancel()
    cancelled.set()
    final = finish(lifecycle)
    assert final.state == trainer_pb2.STAGE_STATE_CANCELLED
    assert edge.aborts == ["cancelled"]


def test_a_cancel_between_steps_stops_at_the_next_step() -> None:
    holder: dict[str, StageLifecycle] = {}
    steps: list[int] = []

    def body() -> None:
        for step in range(1000):
            holder["lifecycle"].raise_if_cancelled()
            steps.append(step)
            if step == 2:
                holder["lifecycle"].cancel()  # e.g. CancelStage arriving between two steps

    lifecycle = holder["lifecycle"] = StageLifecycle("job-4", "encoder", body)
    lifecycle.start()
    assert finish(lifecycle).state == trainer_pb2.STAGE_STATE_CANCELLED
    assert steps == [0, 1, 2]


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (
            ValueError("gradient shape (2,) != activation (3,)"),
            "ValueError: gradient shape (2,) != activation (3,)",
        ),
        (EdgeClosedError("peer side failed: out of memory"), "peer side failed: out of memory"),
    ],
)
def test_a_failure_ends_failed_with_its_reason_and_tells_the_peer(error: Exception, reason: str) -> None:
    edge = BlockingReceive()
    holder: dict[str, StageLifecycle] = {}

    def body() -> None:
        holder["lifecycle"].attach_abort(edge.abort)
        raise error

    lifecycle = holder["lifecycle"] = StageLifecycle("job-5", "decoder", body)
    lifecycle.start()
    final = finish(lifecycle)
    assert final.state == trainer_pb2.STAGE_STATE_FAILED and final.message == reason
    assert edge.aborts == [reason]  # the other cluster's stage fails at once, with the same reason
    assert not lifecycle.cancelled


def test_a_stage_whose_peer_was_cancelled_ends_cancelled_not_failed() -> None:
    """A job is cancelled in both clusters; one stage often learns it from its peer's close first."""
    edge = BlockingReceive()
    holder: dict[str, StageLifecycle] = {}

    def body() -> None:
        holder["lifecycle"].attach_abort(edge.abort)
        edge.receive()

    lifecycle = holder["lifecycle"] = StageLifecycle("job-7", "decoder", body)
    lifecycle.start()
    assert edge.waiting.wait(20)
    edge._items.put(("closed", "peer side failed: cancelled"))  # how the session words the peer's close
    final = finish(lifecycle)
    assert final.state == trainer_pb2.STAGE_STATE_CANCELLED and final.message == PEER_CANCELLED
    assert not lifecycle.cancelled


def test_a_failure_before_the_edge_opens_still_ends_failed() -> None:
    def body() -> None:
        raise FileNotFoundError("no checkpoint at step 4")

    lifecycle = StageLifecycle("job-6", "encoder", body)
    lifecycle.start()
    final = finish(lifecycle)
    assert final.state == trainer_pb2.STAGE_STATE_FAILED
    assert final.message == "FileNotFoundError: no checkpoint at step 4"


def test_finish_callbacks_run_on_the_stage_thread_after_cleanup_even_if_one_raises() -> None:
    events: list[tuple[str, str, int]] = []
    holder: dict[str, StageLifecycle] = {}

    def record(what: str) -> None:
        events.append((what, threading.current_thread().name, holder["lifecycle"].board.latest().state))

    def broken() -> None:
        raise RuntimeError("a broken hook")

    def body() -> None:
        raise ValueError("bad batch")

    lifecycle = holder["lifecycle"] = StageLifecycle(
        "job-7", "encoder", body, cleanup=lambda: record("cleanup")
    )
    lifecycle.add_finish_callback(broken)
    lifecycle.add_finish_callback(lambda: record("finished"))
    lifecycle.start()
    finish(lifecycle)
    failed = trainer_pb2.STAGE_STATE_FAILED
    assert events == [("cleanup", "stage-job-7", failed), ("finished", "stage-job-7", failed)]
