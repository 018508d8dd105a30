"""The overlapped step pipeline: receive-ahead and send threads change when things happen, never what.

Real stages (``ProgramRunner`` with the built-in numbers job) on an in-memory edge pair: the
overlapped path (a receive thread decoding ahead, a sender thread encoding) must train bit for
bit like the serial path (the stage thread receiving and decoding itself), under GPipe and 1F1B,
with a stateful codec; 1F1B must train bit for bit like GPipe; no transfer thread outlives a
stage, whether it finished, failed or was cancelled. ``ReceiveAhead`` on its own: it decodes
ahead up to its depth, in order, and hands edge errors to the stage as the same exception type.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer.config import TrainerSettings
from services.trainer.edge import EdgeClosedError, EdgeSettings
from services.trainer.edge.memory import MemoryLink
from services.trainer.runtime.stage import ProgramRunner
from services.trainer.runtime.timers import OPS, StepTimer
from services.trainer.runtime.transfer import ReceiveAhead
from tests.support.edges import (
    StageRun,
    finish,
    memory_pair,
    run_stages,
    stage_runner,
    wait_for,
    wait_for_step,
)
from tests.support.jobs import numbers_job

pytestmark = pytest.mark.timeout(300)

SETTINGS = EdgeSettings(window_bytes=1 << 20, max_outage_s=20.0, retransmit_s=0.3, ready_timeout_s=30)
STEPS = 4
SUCCEEDED = trainer_pb2.STAGE_STATE_SUCCEEDED


def small_numbers(schedule: str, micro_batches: int = 4, forward: str = "none", backward: str = "none"):  # noqa: ANN201
    return numbers_job(
        steps=STEPS,
        data__batch_size=16,
        data__micro_batches=micro_batches,
        pipeline__schedule=schedule,
        pipeline__max_in_flight=2,
        stages__0__options__d_model=32,
        stages__1__options__d_model=32,
        edges__0__codec__forward=forward,
        edges__0__codec__backward=backward,
    )


def transfer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(("receive-", "send-")) and t.is_alive()]


def assert_bit_identical(reference: tuple[StageRun, StageRun], run: tuple[StageRun, StageRun]) -> None:
    for ref, got in zip(reference, run, strict=True):
        assert got.final.state == SUCCEEDED, got.final.message
        assert got.received == ref.received
        for ours, theirs in zip(got.received_tensors, ref.received_tensors, strict=True):
            assert torch.equal(ours, theirs)
        for ours, theirs in zip(got.parameters(), ref.parameters(), strict=True):
            assert torch.equal(ours, theirs)
    assert run[1].losses() == reference[1].losses()  # exactly, not approximately
    assert sorted(run[1].losses()) == list(range(STEPS))


@pytest.mark.parametrize(
    ("schedule", "forward", "backward"), [("gpipe", "none", "none"), ("1f1b", "ef(int8)", "fp16")]
)
def test_overlapped_path_trains_bit_identical_to_the_serial_path(
    tmp_path: Path, schedule: str, forward: str, backward: str
) -> None:
    job = small_numbers(schedule, forward=forward, backward=backward)
    serial = run_stages(job, tmp_path / "serial", MemoryLink(), SETTINGS, receive_ahead=0)
    overlapped = run_stages(job, tmp_path / "overlap", MemoryLink(), SETTINGS, receive_ahead=3)
    assert_bit_identical(serial, overlapped)
    assert overlapped[0].runner.receive_ahead == 3 and serial[0].runner.receive_ahead == 0
    for run in overlapped:  # every step's time is accounted for per operation
        timings = run.runner.step_timings
        assert len(timings) == STEPS and all(set(t) == set(OPS) for t in timings)
        assert all(t["compute"] > 0 for t in timings)
    downstream = overlapped[1].runner.timer.totals()
    assert downstream["decode"] > 0 and downstream["send"] > 0  # done on the transfer threads
    wait_for(lambda: not transfer_threads(), 10, "the transfer threads to end")


def test_1f1b_trains_bit_identical_to_gpipe(tmp_path: Path) -> None:
    """Same gradients, accumulated in the same micro-batch order: only the order of F and B differs."""
    gpipe = run_stages(small_numbers("gpipe"), tmp_path / "gpipe", MemoryLink(), SETTINGS)
    one_f_one_b = run_stages(small_numbers("1f1b"), tmp_path / "1f1b", MemoryLink(), SETTINGS)
    assert_bit_identical(gpipe, one_f_one_b)


def test_cancel_mid_run_ends_both_stages_and_their_transfer_threads(tmp_path: Path) -> None:
    job = numbers_job(
        steps=1000,
        data__batch_size=16,
        data__micro_batches=4,
        stages__0__options__d_model=32,
        stages__1__options__d_model=32,
    )
    link = MemoryLink()
    runs = [stage_runner(job, index, tmp_path, link, SETTINGS) for index in (0, 1)]
    for run in runs:
        run.runner.start()
    wait_for_step(runs[1], 2)
    assert transfer_threads(), "a running stage has its transfer threads"
    runs[1].runner.cancel()
    for run in runs:
        finish(run, 60)
    assert runs[1].final.state == trainer_pb2.STAGE_STATE_CANCELLED, runs[1].final.message
    # The peer of a cancelled stage ends CANCELLED too, naming why (not FAILED: nothing went wrong).
    assert runs[0].final.state == trainer_pb2.STAGE_STATE_CANCELLED, runs[0].final.message
    assert "cancelled" in runs[0].final.message, runs[0].final.message
    assert "cancelled" in runs[0].final.message
    wait_for(lambda: not transfer_threads(), 10, "the transfer threads of both stages to end")


def test_receive_ahead_decodes_up_to_its_depth_before_the_stage_takes(tmp_path: Path) -> None:
    up, down = memory_pair(MemoryLink(), SETTINGS, codec_forward="ef(int8)")
    sent = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    serial_up, serial_down = memory_pair(MemoryLink(), SETTINGS, codec_forward="ef(int8)")
    timer = StepTimer()
    ahead = ReceiveAhead(down, depth=2, timer=timer)
    serial = ReceiveAhead(serial_down, depth=0)
    try:
        for mb, tensor in enumerate(sent):
            for edge, receiver in ((up, ahead), (serial_up, serial)):
                receiver.expect_tensor(0, mb, [mb])
                edge.send_tensor(tensor, 0, mb, [mb])
        # Nothing taken yet: the thread has decoded exactly ``depth`` items and waits for room.
        wait_for(lambda: ahead._results.full(), 30, "two decoded items waiting")
        assert ahead.pending == 5
        assert timer.totals()["decode"] > 0
        for mb in range(5):
            got, want = ahead.tensor(0, mb), serial.tensor(0, mb)
            assert torch.equal(got, want)  # the stateful decoder saw the same items in the same order
        with pytest.raises(RuntimeError, match="never posted"):
            ahead.tensor(0, 5)
    finally:
        ahead.stop()
        serial.stop()
        for edge in (up, down, serial_up, serial_down):
            edge.abort("test over")
    assert not ahead.alive


def test_an_edge_error_reaches_the_stage_and_ends_the_receive_thread() -> None:
    up, down = memory_pair(MemoryLink(), SETTINGS)
    receiver = ReceiveAhead(down, depth=2)
    try:
        receiver.expect_tensor(0, 0, [0])
        receiver.expect_tensor(0, 1, [1])
        up.send_tensor(torch.ones(2, 2), 0, 1, [1])  # micro-batch 1 where 0 is due
        with pytest.raises(EdgeClosedError, match="schedule mismatch"):
            receiver.tensor(0, 0)
        wait_for(lambda: not receiver.alive, 10, "the receive thread to end after the error")
    finally:
        receiver.stop()
        up.abort("test over")
        down.abort("test over")


def test_stop_ends_a_receive_blocked_on_a_silent_peer() -> None:
    """The stage's lifecycle aborts the edge before its cleanup stops the receiver."""
    up, down = memory_pair(MemoryLink(), SETTINGS)
    receiver = ReceiveAhead(down, depth=2)
    receiver.expect_tensor(0, 0, [0])  # the peer never sends it
    wait_for(lambda: receiver.alive, 10, "the receive thread to start")
    down.abort("cancelled")
    receiver.stop(timeout=10)
    assert not receiver.alive
    with pytest.raises(EdgeClosedError, match="cancelled"):
        receiver.tensor(0, 0)
    up.abort("test over")


def test_the_reason_survives_a_stop_that_wins_the_race_with_the_failure() -> None:
    """If stop() is already under way when the receive fails, the stage still learns why it failed."""
    up, down = memory_pair(MemoryLink(), SETTINGS)
    receiver = ReceiveAhead(down, depth=2)
    receiver.expect_tensor(0, 0, [0])  # the peer never sends it
    wait_for(lambda: receiver.alive, 10, "the receive thread to start")
    receiver._stopping.set()  # the order the race produced: stopping first, then the abort's failure
    down.abort("cancelled")
    wait_for(lambda: not receiver.alive, 10, "the receive thread to end after the abort")
    receiver.stop(timeout=10)
    with pytest.raises(EdgeClosedError, match="cancelled"):
        receiver.tensor(0, 0)
    up.abort("test over")


def test_bad_depth_and_out_of_order_takes_are_refused() -> None:
    up, down = memory_pair(MemoryLink(), SETTINGS)
    try:
        with pytest.raises(ValueError, match="depth must be >= 0"):
            ReceiveAhead(down, depth=-1)
        receiver = ReceiveAhead(down, depth=0)
        receiver.expect_tensor(0, 0, [0])
        with pytest.raises(RuntimeError, match="next posted item is the tensor of step 0 micro-batch 0"):
            receiver.tensor(0, 1)
    finally:
        up.abort("test over")
        down.abort("test over")


def test_a_negative_receive_ahead_is_refused_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "SWITCH_ADDRESS": "127.0.0.1:1",
        "AUTH_ADDRESS": "127.0.0.1:2",
        "CLUSTER_ID": "a",
    }.items():
        monkeypatch.setenv(f"NEBULA_TRAINER_{name}", value)
    monkeypatch.setenv("NEBULA_TRAINER_RECEIVE_AHEAD", "0")
    assert TrainerSettings().receive_ahead == 0  # type: ignore[call-arg]
    monkeypatch.setenv("NEBULA_TRAINER_RECEIVE_AHEAD", "-1")
    with pytest.raises(ValidationError, match="receive_ahead"):
        TrainerSettings()  # type: ignore[call-arg]
    job = small_numbers("gpipe")
    spec = job.stage_spec(job.spec.stages[0].name)
    with pytest.raises(ValueError, match="receive_ahead must be >= 0"):
        ProgramRunner(spec, "token", "unused:0", Path("unused"), "tester", receive_ahead=-1)
