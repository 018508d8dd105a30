"""A trainer with many stages at once still answers at once (AssignStage deadlines).

Before, each running stage parked a thread of asyncio's default executor (6 workers on 2 cores)
in ``join()`` and each watcher polled through another: with more than 5 stages every call that
needed the executor (the audit append of AssignStage, the watches) queued behind them for good.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import pytest

from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.client import TERMINAL, ClusterSession, JobHandle
from tests.support.edges import wait_for
from tests.support.jobs import numbers_job

pytestmark = [pytest.mark.containment, pytest.mark.timeout(120)]
WAITING_STAGES = 16
ANSWER_WITHIN_S = 5.0


class Watcher:
    """Every status of one job's stage on one cluster, read on a thread of its own until terminal."""

    def __init__(self, session: ClusterSession, job_id: str) -> None:
        self.statuses: list[trainer_pb2.StageStatus] = []
        self.error: BaseException | None = None
        self.ended = threading.Event()
        self._thread = threading.Thread(target=self._pump, args=(session, job_id), daemon=True)
        self._thread.start()

    def _pump(self, session: ClusterSession, job_id: str) -> None:
        try:
            for status in session.watch(job_id):
                self.statuses.append(status)
        except BaseException as exc:
            self.error = exc
        finally:
            self.ended.set()

    @property
    def final(self) -> trainer_pb2.StageStatus | None:
        return self.statuses[-1] if self.statuses and self.statuses[-1].state in TERMINAL else None


def _timed(call: Callable[[], object]) -> float:
    started = time.monotonic()
    call()
    return time.monotonic() - started


def test_a_trainer_with_16_stages_answers_assign_and_watch_at_once(
    new_user: Callable[[str, str], ClusterSession],
) -> None:
    crowd = new_user("a", f"crowd{uuid.uuid4().hex[:6]}")
    sessions = {cluster: new_user(cluster, f"busy{uuid.uuid4().hex[:6]}") for cluster in ("a", "b")}
    # Only cluster a's stage of each: it opens its edge and waits for a peer that never comes.
    waiting = [numbers_job(steps=50) for _ in range(WAITING_STAGES)]
    watchers: list[Watcher] = []
    try:
        for job in waiting:
            crowd.assign(job.stage_spec("encoder"))
            watchers.append(Watcher(crowd, job.job_id))
        wait_for(
            lambda: all(w.statuses for w in watchers), 30, "the first status of each of the 16 waiting stages"
        )
        assert not any(w.ended.is_set() for w in watchers), [w.statuses[-1] for w in watchers if w.statuses]

        # A 17th stage (a whole job on both clusters) is admitted and watched at once.
        job = numbers_job(steps=4)
        spec = job.stage_spec("encoder")
        took = _timed(
            lambda: sessions["a"].trainer.AssignStage(
                trainer_pb2.AssignStageRequest(spec=spec),
                metadata=sessions["a"].metadata,
                timeout=ANSWER_WITHIN_S,
            )
        )
        assert took < ANSWER_WITHIN_S
        first = sessions["a"].trainer.WatchStage(
            trainer_pb2.WatchStageRequest(job_id=job.job_id),
            metadata=sessions["a"].metadata,
            timeout=ANSWER_WITHIN_S,
        )
        assert next(iter(first)).job_id == job.job_id
        first.cancel()
        sessions["b"].assign(job.stage_spec("decoder"))
        handle = JobHandle(job, {"encoder": sessions["a"], "decoder": sessions["b"]})
        seen: dict[str, list[int]] = {"encoder": [], "decoder": []}
        for update in handle.updates():
            steps = seen[update.status.stage]
            if not steps or steps[-1] != update.status.steps_done:
                steps.append(update.status.steps_done)
        # Every step's update reached the watcher, in order, and the terminal one ends each stream.
        assert seen == {"encoder": [0, 1, 2, 3, 4], "decoder": [0, 1, 2, 3, 4]}
        assert {s: f.state for s, f in handle.final.items()} == {
            "encoder": trainer_pb2.STAGE_STATE_SUCCEEDED,
            "decoder": trainer_pb2.STAGE_STATE_SUCCEEDED,
        }
    finally:
        for job in waiting[: len(watchers)]:
            crowd.cancel(job.job_id)
    wait_for(lambda: all(w.ended.is_set() for w in watchers), 30, "every watcher of a cancelled stage to end")
    assert [w.error for w in watchers if w.error] == []
    assert {w.final.state if w.final else None for w in watchers} == {trainer_pb2.STAGE_STATE_CANCELLED}
    for session in (crowd, *sessions.values()):
        session.close()
