"""A small job beside a big neighbour that fills the link keeps its step time near its time alone.

On a real deployment at 60 Mbit/s and 20 ms (``nebula local up``'s emulator): the small job
(``examples/digit_sum``) alone, then beside ``bench/faults/big_neighbour`` (4 MiB per micro-batch each
way, codec none). Without the paced, byte-fair link the small job's step took 10x as long beside it;
``make bench-neighbour`` measures the same with a CPU-only control. This check fails above 2x.
"""

from __future__ import annotations

import secrets
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest

from nebula_common.jobspec import load_spec
from nebula_common.launcher import LocalDeployment
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.client import ClusterSession, submit_job
from nebula_common.sdk.jobs import ProgramJob
from services.trainer.history import read_history
from tests.support.accounts import make_user
from tests.support.hostile import ended, stage_status
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
SMALL = ROOT / "examples" / "digit_sum" / "job.yaml"
BIG = ROOT / "bench" / "faults" / "big_neighbour" / "job.yaml"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    run_dir = tmp_path_factory.mktemp("neighbour") / "run"
    with LocalDeployment(run_dir=run_dir, bandwidth_mbit=60.0, delay_ms=20.0) as running:
        yield running


def job(spec: Path, steps: int) -> ProgramJob:
    return ProgramJob(
        load_spec(spec, {"steps": steps, "checkpoint.interval": steps}), f"n-{secrets.token_hex(4)}"
    )


def small_step_seconds(deployment: LocalDeployment, sessions: dict[str, ClusterSession]) -> float:
    """The small job's mean step time (its head stage's own, steps after the second)."""
    small = job(SMALL, 24)
    submit_job(small, sessions, measure_links=False)
    finals = ended(small.job_id, sessions, 300)
    assert {s.state for s in finals.values()} == {trainer_pb2.STAGE_STATE_SUCCEEDED}, finals
    owner = sessions["b"].username
    path = deployment.run_dir / "b" / "trainer" / "stages" / owner / f"{small.job_id}.steps.csv"
    steps: dict[int, float] = {}
    for status in read_history(path, small.job_id, "head"):
        if status.steps_done > 2 and status.step_seconds > 0:
            steps[status.steps_done] = status.step_seconds
    assert len(steps) >= 15, sorted(steps)
    return statistics.mean(steps.values())


def test_a_small_job_beside_a_big_neighbour_keeps_its_step_time(deployment: LocalDeployment) -> None:
    small = {c: make_user(deployment, c, "small") for c in ("a", "b")}
    big = {c: make_user(deployment, c, "big") for c in ("a", "b")}
    alone = small_step_seconds(deployment, small)
    neighbour = job(BIG, 100_000)
    submit_job(neighbour, big, measure_links=False)
    try:
        wait_for(
            lambda: (
                (status := stage_status(big["b"], neighbour.job_id)) is not None and status.steps_done >= 2
            ),
            300,
            "the big job streaming",
        )
        beside = small_step_seconds(deployment, small)
        still = stage_status(big["b"], neighbour.job_id)
        assert still is not None and still.state == trainer_pb2.STAGE_STATE_RUNNING, still  # not pushed out
    finally:
        for session in big.values():
            session.cancel(neighbour.job_id)
    print(f"small job alone {alone:.4f} s, beside the big one {beside:.4f} s: x{beside / alone:.2f}")
    assert beside <= 2.0 * alone, (alone, beside)
