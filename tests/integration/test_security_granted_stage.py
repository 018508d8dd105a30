"""A stage trains on another account's dataset only through the owner's data service, only while granted."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest

from nebula_common.jobspec import load_spec
from nebula_common.jobspec.builtin import builtin_spec
from nebula_common.jobspec.runtime import load_program
from nebula_common.launcher import LocalDeployment
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.client import ClusterSession, submit_job
from nebula_common.sdk.data_client import DataClient
from nebula_common.sdk.jobs import ProgramJob
from nebula_common.sdk.summary import summarize

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
DATASET = "number-words"


def target_records() -> list[object]:
    """The records the numbers job's decoder stage would otherwise load itself (English words)."""
    path = builtin_spec("numbers").parent / "target.py"
    module = load_program(path.read_text(), str(path), ["load_examples"])
    return list(module.load_examples({}))


def granted_job(owner: str, steps: int) -> ProgramJob:
    overrides = {"steps": steps, "stages.1.dataset": f"{owner}/{DATASET}"}
    return ProgramJob(load_spec(builtin_spec("numbers"), overrides))


def data_audit(deployment: LocalDeployment, cluster: str) -> list[dict]:
    log = deployment.run_dir / cluster / "data" / "audit.log"
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.long  # a grant, a job and a revocation (about 25 s) (`make test-faults`)
def test_grantee_stage_trains_through_the_owner_service_and_stops_at_the_next_batch_after_revoke(
    deployment: LocalDeployment,
    sessions: dict[str, ClusterSession],
    new_user: Callable[[str, str], ClusterSession],
) -> None:
    owner = new_user("b", "dora")
    grantee = sessions["b"].username
    with DataClient(deployment.data_address("b"), owner.token) as data:
        data.upload_records(DATASET, target_records())

        # Without a grant the stage cannot even start: the owner's service refuses the first read.
        refused = summarize(job := granted_job("dora", 3), submit_job(job, sessions))
        assert not refused.succeeded
        assert "number-words" in refused.stage_messages["decoder"]

        data.grant(DATASET, grantee)
        ok = summarize(job := granted_job("dora", 4), submit_job(job, sessions))
        assert ok.succeeded, ok.stage_messages
        assert ok.losses[-1] < ok.losses[0] * 1.05  # real training on the granted records

        # Revoke mid-job: the very next batch read is refused and the stage fails, saying why.
        long_job = granted_job("dora", 100_000)
        handle = submit_job(long_job, sessions)
        updates = handle.updates()
        for update in updates:
            if update.status.stage == "decoder" and update.status.steps_done >= 2:
                break
        revoked_at = time.monotonic()
        assert data.revoke(DATASET, grantee)
        for _ in updates:
            pass
    decoder = handle.final["decoder"]
    assert decoder.state == trainer_pb2.STAGE_STATE_FAILED
    assert "number-words" in decoder.message
    assert time.monotonic() - revoked_at < 30

    # The owner's data service recorded every batch the grantee read, and the refusal after the revoke.
    records = data_audit(deployment, "b")
    reads = [r for r in records if r["event"] == "data.read" and r.get("account") == grantee]
    assert any(r["outcome"] == "ok" for r in reads)
    assert reads[-1]["outcome"] == "refused"
    assert any(r["event"] == "data.revoke" for r in records)
