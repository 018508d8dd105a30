"""Stages that misbehave are contained: a fork bomb, an allocation without bound, children left behind,
a process killed outright, a loop that never ends (``docs/stage-isolation.md``).

Each runs on a ``nebula local up`` of its own with small stage limits (1.5 GiB, 128 processes), so
the other tests' deployment never shares a host with a fork bomb. Each must end with its reason in
its status, leave no process 5 s after its end, and leave the trainer serving; the spinning stage is
cancelled within seconds while another account's job trains. Not in ``make test`` (about 1.5 minutes):
``make test-containment``, which CI runs with bubblewrap required.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nebula_common.launcher import LocalDeployment
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.client import ClusterSession, submit_job
from tests.support.accounts import make_user
from tests.support.hostile import ended, host_pids, hostile_job, require_bwrap, run_job, stage_pids
from tests.support.jobs import numbers_job
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.containment, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    """A deployment of its own (fork bombs stay away from the other tests'), with small stage limits."""
    limits = {"NEBULA_TRAINER_STAGE_MEMORY_MB": "1536", "NEBULA_TRAINER_STAGE_MAX_PROCESSES": "128"}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in limits.items():
            patch.setenv(name, value)  # the services inherit it
        running = LocalDeployment(
            run_dir=tmp_path_factory.mktemp("hostile"), bandwidth_mbit=100.0, delay_ms=5.0
        )
        running.start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def tenants(deployment: LocalDeployment) -> dict[str, ClusterSession]:
    require_bwrap(deployment)
    suffix = secrets.token_hex(3)
    return {
        "a": make_user(deployment, "a", f"mallory-{suffix}"),
        "b": make_user(deployment, "b", f"mallory-{suffix}"),
    }


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("fork_bomb", "Resource temporarily unavailable"),  # fork() fails at the group's pids.max
        ("memory", "reached its memory limit (1536 MiB"),  # the control group's OOM kill, named
        ("outlive", "left children behind"),
        ("killed", "killed by signal 9"),  # before its edge was up: the trainer tells the peer
    ],
)
def test_a_stage_that_misbehaves_is_contained_and_leaves_nothing(
    deployment: LocalDeployment, tenants: dict[str, ClusterSession], tmp_path: Path, kind: str, reason: str
) -> None:
    job = hostile_job(tmp_path, kind, {})
    submit_job(job, tenants, measure_links=False)
    final = ended(job.job_id, {"a": tenants["a"]}, 60.0)["encoder"]
    tenants["b"].cancel(job.job_id)  # the other cluster's stage may be waiting out its own timeouts
    ended(job.job_id, tenants, 30.0)
    assert final.state == trainer_pb2.STAGE_STATE_FAILED, final
    assert reason in final.message, final.message
    # Nothing of the stage outlives it by 5 s: not its process, not what it forked or detached.
    wait_for(
        lambda: not host_pids("nebula-outlive-marker") and not stage_pids(),
        5.0,
        f"every process of {kind} gone",
    )
    wait_for(lambda: not host_pids("sleep\x00601"), 5.0, "the detached child gone")
    assert deployment.process("trainer-a").popen.poll() is None  # type: ignore[union-attr]


def test_a_stage_flooding_its_log_adds_a_bounded_amount_to_the_trainers(
    deployment: LocalDeployment, tenants: dict[str, ClusterSession], tmp_path: Path
) -> None:
    """32 MB written to stderr in lines of 100 bytes: the trainer's log grows by the stage's budget
    (256 KiB of burst, 4 KiB/s) and a warning counting what was dropped, not by 32 MB."""
    log = deployment.log_dir / "trainer-a.log"
    before = log.stat().st_size
    job = hostile_job(tmp_path, "log_flood", {})
    submit_job(job, tenants, measure_links=False)
    final = ended(job.job_id, {"a": tenants["a"]}, 120.0)["encoder"]
    tenants["b"].cancel(job.job_id)
    ended(job.job_id, tenants, 30.0)
    assert final.state == trainer_pb2.STAGE_STATE_FAILED and "flood done" in final.message, final
    with log.open("rb") as grown:
        grown.seek(before)
        added = grown.read()
    assert len(added) < 2 << 20, f"the trainer's log grew by {len(added)} bytes"
    said = [line for line in added.splitlines() if b"stage log over its budget" in line]
    assert said and all(job.job_id.encode() in line for line in said), said
    assert deployment.process("trainer-a").popen.poll() is None  # type: ignore[union-attr]


def test_a_spinning_stage_is_cancelled_within_seconds_while_another_job_trains(
    deployment: LocalDeployment, tenants: dict[str, ClusterSession], tmp_path: Path
) -> None:
    job = hostile_job(tmp_path, "spin", {})
    submit_job(job, tenants, measure_links=False)
    wait_for(_spinning, 60.0, "the spinning stage's process running")
    other = numbers_job(steps=6)
    other_final = run_job(
        other,
        {
            "a": make_user(deployment, "a", f"bystander-{secrets.token_hex(3)}"),
            "b": make_user(deployment, "b", f"bystander-{secrets.token_hex(3)}"),
        },
    )
    assert all(s.state == trainer_pb2.STAGE_STATE_SUCCEEDED for s in other_final.values()), other_final
    cancelled = time.monotonic()
    for session in tenants.values():
        session.cancel(job.job_id)
    finals = ended(job.job_id, tenants, 10.0)
    assert finals["encoder"].state == trainer_pb2.STAGE_STATE_CANCELLED, finals
    wait_for(lambda: not _spinning(), 5.0, "the spinning process gone within 5 s of its end")
    assert time.monotonic() - cancelled < 10.0


def _spinning() -> bool:
    """A stage process burning CPU (the spin job's only process in state R for long)."""
    return any(_cpu_seconds(pid) > 1.0 for pid in stage_pids())


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
