"""Per-job WAN series of the switch: each job counted on its own, and gone once the job has ended.

Real link messages go through the real counting path (``DirectionCounters.count``, which the link's
pumps call for every message) and the real Prometheus registry is read back as ``/metrics`` shows it.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from nebula_common.clients.endpoints import ClusterEndpoints
from nebula_common.proto.nebula.v1 import link_pb2, relay_pb2, tensor_pb2
from nebula_common.sdk.client import ClusterSession
from nebula_common.sdk.summary import job_wan_counters
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
    # Other tests' jobs may be swept here too (the registry is the process's): only job-1 is pinned.
    assert "job-1" not in JOB_SERIES.sweep(force=True)  # open: stays, however long ago its last byte
    assert job_samples("job-1")[("nebula_switch_job_wan_raw_bytes_total", "received")] == 400
    # closed() sweeps too (at most once a second), so on a slow host it may already have removed job-1.
    JOB_SERIES.closed("job-1")
    JOB_SERIES.sweep(force=True)
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
    assert "job-2" not in JOB_SERIES.sweep(force=True) and job_samples("job-2")
    # A job the peer sends items of but that never had an edge here goes the same way.
    for message in frame("job-stray", 8, b"ab"):
        sent.count(message)
    gone = JOB_SERIES.sweep(now=10**12, force=True)
    assert {"job-2", "job-stray"} <= set(gone)
    assert job_samples("job-2") == {} == job_samples("job-stray")
    metrics.forget_job("never-seen")  # nothing to remove: no error


def test_a_middle_switch_counts_each_peer_of_a_job_apart_and_the_summary_reads_one_edge(
    no_grace: None,
) -> None:
    """A chain's middle cluster: one job, two links (to a and to c); each edge's series are its own."""
    to_a, to_c = DirectionCounters("sent", "a"), DirectionCounters("sent", "c")
    JOB_SERIES.opened("job-chain")
    for message in frame("job-chain", 4000, b"g" * 1000):  # gradients up to a (int8-sized)
        to_a.count(message)
    for message in frame("job-chain", 4000, b"x" * 2000) * 2:  # activations down to c (fp16-sized)
        to_c.count(message)
    by_peer: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for sample in family.samples:
            if (
                sample.labels.get("job_id") == "job-chain"
                and sample.name == "nebula_switch_job_wan_raw_bytes_total"
            ):
                by_peer[sample.labels["peer"]] = sample.value
    assert by_peer == {"a": 4000, "c": 8000}

    # The SDK's reader over real HTTP: one peer's numbers, or all peers together.
    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = generate_latest(REGISTRY)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        endpoints = ClusterEndpoints(
            cluster_id="b", auth="", trainer="", switch="", metrics={"switch-b": url}
        )
        session = ClusterSession(endpoints, "token", "tester")
        to_c_only = job_wan_counters(session, "job-chain", peer="c")
        both = job_wan_counters(session, "job-chain")
        assert to_c_only is not None and both is not None
        assert (to_c_only["sent"]["raw_bytes"], to_c_only["sent"]["payload_bytes"]) == (8000, 4000)
        assert to_c_only["sent"]["frames"] == 2 and both["sent"]["frames"] == 3
        assert both["sent"]["raw_bytes"] == 12000
        session.close()
    finally:
        server.shutdown()
        server.server_close()
    JOB_SERIES.closed("job-chain")
    assert "job-chain" in JOB_SERIES.sweep(force=True)
    assert job_samples("job-chain") == {}  # both peers' series went
