"""Trainer-side checks that need no cluster: spec validation and the status history watchers read."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from nebula_common.errors import InvalidRequestError
from nebula_common.jobspec import load_spec
from nebula_common.jobspec.builtin import builtin_spec
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.jobs import ProgramJob
from services.trainer.status import StatusBoard
from services.trainer.validation import validate_stage_spec

pytestmark = pytest.mark.timeout(30)


def good_spec() -> trainer_pb2.StageSpec:
    loaded = load_spec(builtin_spec("numbers"), {"steps": 3, "edges.0.codec.forward": "fp16"})
    return ProgramJob(loaded, job_id="job-1").stage_spec("encoder")


def test_a_good_spec_passes() -> None:
    validate_stage_spec(good_spec())


@pytest.mark.parametrize(
    ("mutate", "named"),
    [
        (lambda s: setattr(s, "job_id", "bad id!"), "job_id"),
        (lambda s: setattr(s, "stage", "mid stage!"), "stage 'mid stage!'"),
        (lambda s: setattr(s.program, "role", "sideways"), "program.role 'sideways'"),
        (lambda s: setattr(s.program, "module_source", "def build(:"), "program.module_source: line 1"),
        (lambda s: setattr(s, "steps", 0), "steps 0"),
        (lambda s: setattr(s, "codec_forward", "zip9"), "codec_forward"),
        (lambda s: setattr(s, "codec_backward", "fp16(0.5)"), "codec_backward"),
        (lambda s: setattr(s.program, "micro_batches", 3), "micro_batches 3"),
        (lambda s: setattr(s.program.optimizer, "learning_rate", 20.0), "learning_rate"),
    ],
)
def test_each_bad_field_is_named(mutate: Callable[[trainer_pb2.StageSpec], None], named: str) -> None:
    spec = good_spec()
    mutate(spec)
    with pytest.raises(InvalidRequestError, match=named.replace("(", r"\(").replace(")", r"\)")):
        validate_stage_spec(spec)


def test_all_problems_are_reported_at_once() -> None:
    spec = good_spec()
    spec.steps = 0
    spec.stage = "mid stage!"
    with pytest.raises(InvalidRequestError) as error:
        validate_stage_spec(spec)
    assert "steps" in str(error.value) and "stage" in str(error.value)


def test_status_history_gives_every_step_to_a_slow_watcher() -> None:
    board = StatusBoard("job", "decoder")
    board.update(state=trainer_pb2.STAGE_STATE_RUNNING)
    for step in range(1, 6):
        board.update(steps_done=step, loss=1.0 / step)
    board.update(state=trainer_pb2.STAGE_STATE_SUCCEEDED)
    version, updates = board.since(0, timeout=0)
    assert [u.steps_done for u in updates[:-1] if u.HasField("loss")] == [1, 2, 3, 4, 5]
    assert updates[-1].state == trainer_pb2.STAGE_STATE_SUCCEEDED
    assert updates[-1].loss == 1.0 / 5  # the end keeps the last step's loss (`nebula job list` shows it)
    assert board.finished
    assert board.since(version, timeout=0) == (version, [])


@pytest.mark.parametrize(
    "end",
    [trainer_pb2.STAGE_STATE_SUCCEEDED, trainer_pb2.STAGE_STATE_FAILED, trainer_pb2.STAGE_STATE_CANCELLED],
)
def test_the_end_keeps_the_last_steps_loss_and_step_time_but_no_other_update_does(end: int) -> None:
    board = StatusBoard("job", "decoder")
    board.update(state=trainer_pb2.STAGE_STATE_RUNNING)
    board.update(steps_done=7, loss=0.25, local_loss=0.5, step_seconds=0.125)
    board.update(message="waiting for the WAN link")  # no step: no loss of its own
    assert not board.latest().HasField("loss") and not board.latest().HasField("local_loss")
    board.update(state=end, message="how it ended")
    final = board.latest()
    assert (final.state, final.steps_done, final.loss, final.local_loss, final.step_seconds) == (
        end,
        7,
        0.25,
        0.5,
        0.125,
    )


def test_an_end_before_any_step_has_no_loss() -> None:
    board = StatusBoard("job", "decoder")
    board.update(state=trainer_pb2.STAGE_STATE_RUNNING)
    board.update(state=trainer_pb2.STAGE_STATE_FAILED, message="bad batch")
    assert not board.latest().HasField("loss") and not board.latest().HasField("local_loss")


def test_watcher_wakes_up_on_the_next_update() -> None:
    board = StatusBoard("job", "encoder")
    version, _ = board.since(0, timeout=0)
    timer = threading.Timer(0.05, lambda: board.update(steps_done=1))
    timer.start()
    new_version, updates = board.since(version, timeout=5)
    assert new_version == version + 1 and updates[0].steps_done == 1


def test_an_asyncio_watcher_is_woken_by_an_update_from_another_thread_without_a_thread_of_its_own() -> None:
    board = StatusBoard("job", "encoder")

    async def watch() -> list[int]:
        version, first = await board.wait_since(0)  # the initial PENDING status is there at once
        assert [u.state for u in first] == [trainer_pb2.STAGE_STATE_PENDING]
        threads_before = threading.active_count()
        steps: list[int] = []
        updater = threading.Thread(target=lambda: [board.update(steps_done=s) for s in (1, 2, 3)])
        waiting = asyncio.ensure_future(board.wait_since(version))
        await asyncio.sleep(0)  # the watcher is parked on its future now
        assert threading.active_count() == threads_before
        updater.start()
        while len(steps) < 3:
            version, updates = await asyncio.wait_for(waiting, 10)
            steps += [u.steps_done for u in updates]
            waiting = asyncio.ensure_future(board.wait_since(version))
        waiting.cancel()
        updater.join(10)
        return steps

    assert asyncio.run(watch()) == [1, 2, 3]
    assert not board._waiters  # a cancelled watcher leaves nothing behind
