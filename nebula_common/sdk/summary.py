"""What a finished split job did: losses, timings, and bytes on the WAN as the switches counted them."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from nebula_common.proto.nebula.v1 import relay_pb2, trainer_pb2
from nebula_common.sdk.client import ClusterSession, JobHandle, SubmittedJob


def scrape_counter(url: str, name: str, labels: dict[str, str]) -> float | None:
    """Read one counter sample from a Prometheus endpoint (None if absent)."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def settled_link_status(
    sessions: list[ClusterSession], timeout: float = 5.0
) -> dict[str, relay_pb2.LinkStatus]:
    """Both switches' link status once every byte one sent has been received by the other.

    When a job ends, its final close messages may still be crossing the WAN;
    reading the counters at that instant would show the two sides disagreeing.
    """
    deadline = time.monotonic() + timeout
    while True:
        status = {s.endpoints.cluster_id: s.link_status() for s in sessions}
        first, second = status.values()
        settled = first.sent.bytes == second.received.bytes and second.sent.bytes == first.received.bytes
        if settled or time.monotonic() > deadline:
            return status
        time.sleep(0.05)


@dataclass
class JobSummary:
    job_id: str
    steps: int
    losses: list[float] = field(default_factory=list)
    local_losses: dict[str, list[float]] = field(default_factory=dict)  # one_way upstream's own loss
    step_seconds: list[float] = field(default_factory=list)
    wait_seconds: dict[str, float] = field(default_factory=dict)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    checkpoint_steps: dict[str, int] = field(default_factory=dict)
    stage_states: dict[str, str] = field(default_factory=dict)
    stage_messages: dict[str, str] = field(default_factory=dict)
    train_seconds: float = 0.0
    total_seconds: float = 0.0
    wan: dict[str, dict[str, Any]] = field(default_factory=dict)
    peer_identities: dict[str, str] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def steps_done(self) -> int:
        return len(self.step_seconds)

    @property
    def mean_step_seconds(self) -> float:
        return sum(self.step_seconds) / len(self.step_seconds) if self.step_seconds else 0.0

    @property
    def succeeded(self) -> bool:
        return bool(self.stage_states) and all(s == "SUCCEEDED" for s in self.stage_states.values())

    def fill_wan(self, source: ClusterSession, target: ClusterSession) -> None:
        """Take WAN byte counts from both switches and cross-check them with their Prometheus counters."""
        links = settled_link_status([source, target])
        status = {s.endpoints.cluster_id: (s, links[s.endpoints.cluster_id]) for s in (source, target)}
        src_id, dst_id = source.endpoints.cluster_id, target.endpoints.cluster_id
        for cluster, (_, link) in status.items():
            self.peer_identities[cluster] = link.verified_peer_identity
        for direction, sender, receiver in (("forward", src_id, dst_id), ("backward", dst_id, src_id)):
            session, link = status[sender]
            sent = link.sent
            received = status[receiver][1].received
            entry: dict[str, Any] = {
                "from": sender,
                "to": receiver,
                "bytes": sent.bytes,
                "payload_bytes": sent.payload_bytes,
                "raw_bytes": sent.raw_bytes,
                "frames": sent.frames,
                "bytes_received_by_peer": received.bytes,
                "compression_ratio": (sent.raw_bytes / sent.payload_bytes) if sent.payload_bytes else 0.0,
                "wire_ratio": (sent.raw_bytes / sent.bytes) if sent.bytes else 0.0,
            }
            url = session.endpoints.metrics.get(f"switch-{sender}")
            if url:
                value = scrape_counter(url, "nebula_switch_wan_bytes_total", {"direction": "sent"})
                entry["prometheus_bytes"] = int(value) if value is not None else None
            self.wan[direction] = entry

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "steps": self.steps_done,
            "steps_requested": self.steps,
            "succeeded": self.succeeded,
            "stage_states": self.stage_states,
            "stage_messages": self.stage_messages,
            "loss_per_step": self.losses,
            "local_loss_per_step": self.local_losses,
            "initial_loss": self.losses[0] if self.losses else None,
            "final_loss": self.losses[-1] if self.losses else None,
            "train_wall_seconds": self.train_seconds,
            "wall_seconds": self.total_seconds,
            "mean_step_seconds": self.mean_step_seconds,
            "wait_seconds": self.wait_seconds,
            "wait_fraction": {
                stage: (self.wait_seconds[stage] / total) if total else 0.0
                for stage, total in self.stage_seconds.items()
            },
            "checkpoint_steps": self.checkpoint_steps,
            "wan": self.wan,
            "peer_identities": self.peer_identities,
            "settings": self.settings,
        }


def summarize(
    job: SubmittedJob,
    handle: JobHandle,
    on_step: Callable[[trainer_pb2.StageStatus], None] | None = None,
    on_status: Callable[[trainer_pb2.StageStatus], None] | None = None,
) -> JobSummary:
    """Follow a job to its end, collecting the loss-owning stage's per-step numbers.

    ``on_step`` sees each step of the loss-owning stage; ``on_status`` every status of every stage
    (e.g. to show a stage RECOVERING after its trainer restarted).
    """
    summary = JobSummary(job_id=job.job_id, steps=job.steps)
    started = time.perf_counter()
    last_step: dict[str, int] = {}
    for update in handle.updates():
        status = update.status
        stage = status.stage
        if on_status is not None:
            on_status(status)
        summary.stage_states[stage] = trainer_pb2.StageState.Name(status.state).removeprefix("STAGE_STATE_")
        summary.stage_messages[stage] = status.message
        if status.steps_done > last_step.get(stage, 0):
            last_step[stage] = status.steps_done
            summary.wait_seconds[stage] = summary.wait_seconds.get(stage, 0.0) + status.wait_seconds
            summary.stage_seconds[stage] = summary.stage_seconds.get(stage, 0.0) + status.step_seconds
            summary.checkpoint_steps[stage] = int(status.checkpoint_step)
            if status.HasField("local_loss"):
                summary.local_losses.setdefault(stage, []).append(status.local_loss)
            if status.HasField("loss"):
                summary.losses.append(status.loss)
                summary.step_seconds.append(status.step_seconds)
                if on_step is not None:
                    on_step(status)
    summary.train_seconds = time.perf_counter() - started
    return summary
