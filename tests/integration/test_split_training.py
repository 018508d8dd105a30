"""The numbers job across two real clusters: loss falls, and the WAN byte counts agree with the codecs."""

from __future__ import annotations

import time

import pytest

from nebula_common.launcher import LocalDeployment
from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.sdk.client import ClusterSession, submit_job
from nebula_common.sdk.jobs import ProgramJob
from nebula_common.sdk.summary import JobSummary, scrape_counter, settled_link_status, summarize
from tests.support.jobs import numbers_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
# Before step 0 the decoder sends the encoder a READY signal: control, not tensor payload, so the
# payload counters below hold exactly the activations and gradients.


def link_snapshot(sessions: dict[str, ClusterSession]) -> dict[str, relay_pb2.LinkStatus]:
    return settled_link_status(list(sessions.values()))


def sent_delta(before: dict, after: dict, cluster: str, field: str) -> int:
    return getattr(after[cluster].sent, field) - getattr(before[cluster].sent, field)


def run_job(
    sessions: dict[str, ClusterSession], job: ProgramJob
) -> tuple[JobSummary, dict[str, relay_pb2.LinkStatus], dict[str, relay_pb2.LinkStatus]]:
    before = link_snapshot(sessions)
    summary = summarize(job, submit_job(job, sessions))
    after = link_snapshot(sessions)
    return summary, before, after


def test_split_job_trains_and_switches_count_every_byte(
    deployment: LocalDeployment, sessions: dict[str, ClusterSession]
) -> None:
    job = numbers_job(steps=25, data__micro_batches=2, data__batch_size=64)
    summary, before, after = run_job(sessions, job)

    assert summary.succeeded, summary.stage_messages
    assert len(summary.losses) == 25
    assert sum(summary.losses[-5:]) / 5 < 0.8 * sum(summary.losses[:5]) / 5

    # Both switches saw the same traffic, each from its own side of the link.
    for sender, receiver in (("a", "b"), ("b", "a")):
        sent = sent_delta(before, after, sender, "bytes")
        received = after[receiver].received.bytes - before[receiver].received.bytes
        assert sent == received > 0
    # With codec none the payload is exactly the raw tensors: 25 steps x 2 micro-batches x 32x4x128 fp32.
    expected_raw = 25 * 2 * 32 * 4 * 128 * 4
    assert sent_delta(before, after, "a", "raw_bytes") == expected_raw
    assert sent_delta(before, after, "a", "payload_bytes") == expected_raw
    assert sent_delta(before, after, "b", "payload_bytes") == expected_raw
    assert sent_delta(before, after, "a", "frames") == 50

    # The Prometheus counters are the same numbers the RPC reports (read between two equal RPC reads:
    # the link's keepalives may add bytes at any moment).
    for cluster in ("a", "b"):
        url = deployment.endpoints(cluster).metrics[f"switch-{cluster}"]
        readings: list[tuple[int, float | None, int]] = []
        deadline = time.monotonic() + 30
        while not readings or not readings[-1][0] == readings[-1][1] == readings[-1][2]:
            assert time.monotonic() < deadline, (
                f"switch {cluster}: RPC, scrape, RPC never agreed: {readings[-5:]}"
            )
            first = sessions[cluster].link_status().sent.bytes
            scraped = scrape_counter(url, "nebula_switch_wan_bytes_total", {"direction": "sent"})
            readings.append((first, scraped, sessions[cluster].link_status().sent.bytes))

    # Each switch verified the other's identity from its certificate.
    assert after["a"].verified_peer_identity == "spiffe://nebula/cluster/b/switch"
    assert after["b"].verified_peer_identity == "spiffe://nebula/cluster/a/switch"
    assert {after["a"].link_role, after["b"].link_role} == {"dialer", "acceptor"}
    # What `nebula local up` gives: the records link carrier, on both switches.
    assert after["a"].link_carrier == after["b"].link_carrier == "records"


@pytest.mark.long  # two jobs, one after the other (`make test-faults`)
def test_codecs_shrink_wan_bytes_by_their_ratio(sessions: dict[str, ClusterSession]) -> None:
    plain, plain_before, plain_after = run_job(sessions, numbers_job(steps=4, data__batch_size=64))
    packed, packed_before, packed_after = run_job(
        sessions,
        numbers_job(
            steps=4, data__batch_size=64, edges__0__codec__forward="fp16", edges__0__codec__backward="int8"
        ),
    )
    assert plain.succeeded and packed.succeeded, (plain.stage_messages, packed.stage_messages)

    forward_ratio = sent_delta(packed_before, packed_after, "a", "bytes") / sent_delta(
        plain_before, plain_after, "a", "bytes"
    )
    backward_ratio = sent_delta(packed_before, packed_after, "b", "bytes") / sent_delta(
        plain_before, plain_after, "b", "bytes"
    )
    assert forward_ratio == pytest.approx(0.5, abs=0.02)
    assert backward_ratio == pytest.approx(0.25, abs=0.02)
    # Payload accounting is exact: fp16 is 2 bytes/value, int8 is 1 byte/value plus a 4-byte scale.
    values = 4 * 2 * 32 * 4 * 128
    assert sent_delta(packed_before, packed_after, "a", "payload_bytes") == values * 2
    backward = values + 8 * 4
    assert sent_delta(packed_before, packed_after, "b", "payload_bytes") == backward
