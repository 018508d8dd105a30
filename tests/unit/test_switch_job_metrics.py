"""Per-job WAN series of the switch: each job counted on its own, and gone once the job has ended.

Real link messages go through the real counting path (``DirectionCounters.count``, which the link's
pumps call for every message) and the real Prometheus registry is read back as ``/metrics`` shows it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from nebula_common.proto.nebula.v1 import link_pb2, relay_pb2, tensor_pb2
from services.switch import metrics
from services.switch.metrics import JOB_SERIES, DirectionCounters

pytestmark = pytest.mark.timeout(30)


def frame(job_id: str, raw_size: int, payload: bytes) -> list[link_pb2.LinkMessage]:
    """One tensor frame of ``job_id`` as it crosses the link: its header, then one chunk."""
    parts = (
        tensor_pb2.TensorFrame(header=tensor_pb2.TensorHeader(job_id=job_id, raw_size=raw_size)),
        tensor_pb2.TensorFrame(chunk=tensor_pb2.TensorChunk(data=payload, last=True)),
    )
    return [
        link_pb2.LinkMessage(
            routed=link_pb2.RoutedItem(job_id=job_id, edge="e->d", item=relay_pb2.EdgeMessage(frame=part))
        )
        for part in parts
    ]


def job_samples(job_id: str) -> dict[tuple[str, str], float]:
    """(sample name, direction) -> value of every per-job series of ``job_id`` on /metrics now."""
    found = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for sample in family.samples:
            if sample.labels.get("job_id") == job_id and sample.name.startswith("nebula_switch_job_"):
                found[(sample.name, sample.labels["direction"])] = sample.value
    return found


@pytest.fixture
def no_grace(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(JOB_SERIES, "grace_s", 0.0)
    yield
    JOB_SERIES.sweep(force=True)


def test_each_job_has_its_own_bytes_frames_and_ratio(no_grace: None) -> None:
    sent = DirectionCounters("sent")
    JOB_SERIES.opened("job-fp16")
    JOB_SERIES.opened("job-int8")
    for message in frame("job-fp16", 4000, b"x" * 2000) + frame("job-int8", 4000, b"y" * 1000):
        sent.count(message)
    fp16, int8 = job_samples("job-fp16"), job_samples("job-int8")
    assert fp16[("nebula_switch_job_wan_raw_bytes_total", "sent")] == 4000
    assert fp16[("nebula_switch_job_wan_payload_bytes_total", "sent")] == 2000
    assert int8[("nebula_switch_job_wan_payload_bytes_total", "sent")] == 1000
    assert fp16[("nebula_switch_job_frames_relayed_total", "sent")] == 1
    # The wire bytes of each job are its own messages' sizes; the link's lifetime total is their sum.
    fp16_wire = sum(m.ByteSize() for m in frame("job-fp16", 4000, b"x" * 2000))
    int8_wire = sum(m.ByteSize() for m in frame("job-int8", 4000, b"y" * 1000))
    assert fp16[("nebula_switch_job_wan_bytes_total", "sent")] == fp16_wire
    assert int8[("nebula_switch_job_wan_bytes_total", "sent")] == int8_wire
    assert sent.bytes == fp16_wire + int8_wire
    JOB_SERIES.closed("job-fp16")
    JOB_SERIES.closed("job-int8")


def test_a_jobs_series_stay_while_an_edge_is_open_and_go_after_it_closed(no_grace: None) -> None:
    received = DirectionCounters("received")
    JOB_SERIES.opened("job-1")
    for message in frame("job-1", 400, b"z" * 100):
        received.count(message)
    assert JOB_SERIES.sweep(force=True) == []  # open: stays, however long ago its last byte
    assert job_samples("job-1")[("nebula_switch_job_wan_raw_bytes_total", "received")] == 400
    JOB_SERIES.closed("job-1")
    assert JOB_SERIES.sweep(force=True) == ["job-1"]
    assert job_samples("job-1") == {}


def test_the_grace_period_keeps_an_ended_jobs_series_for_the_last_scrape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(JOB_SERIES, "grace_s", 3600.0)
    sent = DirectionCounters("sent")
    JOB_SERIES.opened("job-2")
    for message in frame("job-2", 8, b"ab"):
        sent.count(message)
    JOB_SERIES.closed("job-2")
    assert JOB_SERIES.sweep(force=True) == [] and job_samples("job-2")
    # A job the peer sends items of but that never had an edge here goes the same way.
    for message in frame("job-stray", 8, b"ab"):
        sent.count(message)
    gone = JOB_SERIES.sweep(now=10**12, force=True)
    assert {"job-2", "job-stray"} <= set(gone)
    assert job_samples("job-2") == {} == job_samples("job-stray")
    metrics.forget_job("never-seen")  # nothing to remove: no error
