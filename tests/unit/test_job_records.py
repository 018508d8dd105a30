"""A job's record merged from its stages' records: how it ended, traffic, owners (no cluster needed)."""

from __future__ import annotations

import pytest

from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.job_records import JobRecord, StageView

pytestmark = pytest.mark.timeout(30)


def stage(name: str, cluster: str, state: int, message: str = "", **status: object) -> StageView:
    info = trainer_pb2.StageRecordInfo(
        status=trainer_pb2.StageStatus(job_id="job-1", stage=name, state=state, message=message, **status),
        owner=f"user-{cluster}",
        spec_digest="d" * 64,
        started_unix=100.0 if cluster == "a" else 101.0,
        ended_unix=200.0 if state in (3, 4, 5) else 0.0,
        steps=10,
        edge="encoder->decoder",
    )
    return StageView.from_info(cluster, info)


S = trainer_pb2


@pytest.mark.parametrize(
    ("states", "job_state"),
    [
        ((S.STAGE_STATE_SUCCEEDED, S.STAGE_STATE_SUCCEEDED), "SUCCEEDED"),
        ((S.STAGE_STATE_CANCELLED, S.STAGE_STATE_FAILED), "CANCELLED"),
        ((S.STAGE_STATE_SUCCEEDED, S.STAGE_STATE_FAILED), "FAILED"),
        ((S.STAGE_STATE_RUNNING, S.STAGE_STATE_RECOVERING), "RECOVERING"),
        ((S.STAGE_STATE_SUCCEEDED, S.STAGE_STATE_RUNNING), "RUNNING"),
        ((S.STAGE_STATE_PENDING, S.STAGE_STATE_PENDING), "PENDING"),
    ],
)
def test_how_a_job_stands_follows_its_stages(states: tuple[int, int], job_state: str) -> None:
    job = JobRecord("job-1", [stage("encoder", "a", states[0]), stage("decoder", "b", states[1])])
    assert job.state == job_state
    assert job.ended == (job_state in ("SUCCEEDED", "FAILED", "CANCELLED"))
    assert (job.ended_unix is not None) == job.ended


def test_a_jobs_record_has_owners_clusters_traffic_and_the_loss_owners_loss() -> None:
    encoder = stage(
        "encoder",
        "a",
        S.STAGE_STATE_RUNNING,
        steps_done=4,
        bytes_sent=500,
        raw_bytes_sent=1000,
        codec_forward="fp16",
        codec_backward="int8",
    )
    decoder = stage(
        "decoder",
        "b",
        S.STAGE_STATE_RUNNING,
        steps_done=3,
        loss=0.5,
        bytes_sent=250,
        raw_bytes_sent=1000,
        codec_forward="fp16",
        codec_backward="int8",
    )
    body = JobRecord("job-1", [decoder, encoder]).to_json()
    assert body["clusters"] == {"encoder": "a", "decoder": "b"}  # upstream first, whatever the order asked
    assert body["owners"] == {"a": "user-a", "b": "user-b"}
    assert (body["steps_done"], body["steps"], body["loss"]) == (3, 10, 0.5)
    assert body["traffic"]["forward"] == {
        "bytes": 500,
        "raw_bytes": 1000,
        "compression_ratio": 2.0,
        "codec": "fp16",
    }
    assert (
        body["traffic"]["backward"]["compression_ratio"] == 4.0
        and body["traffic"]["backward"]["codec"] == "int8"
    )
    assert body["spec_digest"] == "d" * 64 and body["started_unix"] == 100.0


def test_a_chains_record_lists_its_stages_in_chain_order_and_the_last_owns_the_loss() -> None:
    def chained(name: str, cluster: str, edge: str, started: float, **status: object) -> StageView:
        info = trainer_pb2.StageRecordInfo(
            status=trainer_pb2.StageStatus(job_id="job-1", stage=name, state=S.STAGE_STATE_RUNNING, **status),
            owner=f"user-{cluster}",
            started_unix=started,
            steps=10,
            edge=edge,
        )
        return StageView.from_info(cluster, info)

    reader = chained("reader", "a", "reader->mixer", 102.0, steps_done=4, bytes_sent=500)
    mixer = chained("mixer", "b", "reader->mixer", 100.0, steps_done=4, bytes_sent=900)  # no loss
    head = chained("head", "c", "mixer->head", 101.0, steps_done=3, loss=0.5, bytes_sent=250)
    job = JobRecord("job-1", [head, mixer, reader])
    body = job.to_json()
    assert body["clusters"] == {"reader": "a", "mixer": "b", "head": "c"}
    assert job.downstream is head and body["loss"] == 0.5
    assert body["traffic"]["backward"]["bytes"] == 250
