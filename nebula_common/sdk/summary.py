"""What a finished split job did: losses, timings, and bytes on the WAN as the switches counted them.

The WAN numbers are this job's own: the switches' per-job series (``nebula_switch_job_*``, labels
``job_id`` and ``direction``), never their lifetime link counters, which add up every job a
deployment ever ran (a codec saving 4x showed x1.33 on a deployment's second job). Where a
switch's metrics endpoint is not known or not readable (a description without metrics ports; no
monitoring identity at hand: ``/metrics`` serve the cluster's Prometheus and operators only), the
trainers' per-stage edge counters stand in (``counted_by: trainers``): also per job, but payload
bytes only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from nebula_common.metrics import MetricsReadError, read_metrics
from nebula_common.proto.nebula.v1 import relay_pb2, trainer_pb2
from nebula_common.sdk.client import ClusterSession, JobHandle, SubmittedJob
from nebula_common.sdk.jobs import ProgramJob


def scrape_counter(url: str, name: str, labels: dict[str, str]) -> float | None:
    """Read one counter sample from a Prometheus endpoint (None if absent)."""
    text = read_metrics(url)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


_JOB_SERIES = {
    "nebula_switch_job_wan_bytes_total": "bytes",
    "nebula_switch_job_wan_payload_bytes_total": "payload_bytes",
    "nebula_switch_job_wan_raw_bytes_total": "raw_bytes",
    "nebula_switch_job_frames_relayed_total": "frames",
}


def job_wan_counters(
    session: ClusterSession, job_id: str, peer: str | None = None
) -> dict[str, dict[str, int]] | None:
    """The job's per-job counters on the session's switch, per direction ("sent", "received").

    ``peer``: only what crossed the link to that cluster's switch (a chain's middle cluster has
    two); None: all peers together. None when the deployment description gave no metrics
    endpoint for that switch. A job the switch has no series of (nothing crossed, or its series
    already left after their grace period) reads as zeros.
    """
    url = session.endpoints.metrics.get(f"switch-{session.endpoints.cluster_id}")
    if not url:
        return None
    try:
        text = read_metrics(url)
    except MetricsReadError:  # no monitoring identity at hand (a tenant's view): the trainers count
        return None
    counts = {direction: dict.fromkeys(_JOB_SERIES.values(), 0) for direction in ("sent", "received")}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = _JOB_SERIES.get(sample.name)
            direction = sample.labels.get("direction", "")
            ours = sample.labels.get("job_id") == job_id and peer in (None, sample.labels.get("peer"))
            if key and ours and direction in counts:
                counts[direction][key] += int(sample.value)
    return counts


def settled_job_counters(
    source: ClusterSession,
    target: ClusterSession,
    job_id: str,
    timeout: float = 5.0,
    per_peer: bool = False,
) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]] | None:
    """Both switches' counters of the job once each side has received what the other sent.

    The job's last close messages may still be crossing the WAN when its stages end; reading at
    that instant would show the two switches disagreeing. None if either has no metrics endpoint.
    ``per_peer``: only the link between these two switches (one edge of a chain).
    """
    deadline = time.monotonic() + timeout
    peers = (target.endpoints.cluster_id, source.endpoints.cluster_id) if per_peer else (None, None)
    while True:
        first = job_wan_counters(source, job_id, peers[0])
        second = job_wan_counters(target, job_id, peers[1])
        if first is None or second is None:
            return None
        settled = (
            first["sent"]["bytes"] == second["received"]["bytes"]
            and second["sent"]["bytes"] == first["received"]["bytes"]
        )
        if settled or time.monotonic() > deadline:
            return first, second
        time.sleep(0.05)


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


def link_summary(status: relay_pb2.LinkStatus) -> dict[str, Any]:
    """One switch link for a summary: the peer it names, whether it is up, who answered, its role."""
    return {
        "peer": status.expected_peer,
        "connected": status.connected,
        "verified_peer_identity": status.verified_peer_identity,
        "link_role": status.link_role,
        "link_sessions": status.link_sessions,
        "link_carrier": status.link_carrier,
    }


@dataclass(frozen=True)
class ChainEdgeInfo:
    """One edge of a chain as the summary names it: its stages and their clusters."""

    name: str
    from_stage: str
    to_stage: str
    from_cluster: str
    to_cluster: str


def chain_edges(job: ProgramJob) -> list[ChainEdgeInfo]:
    """Every edge of the job in chain order (edge K: stage K -> stage K+1)."""
    stages = job.spec.stages
    return [
        ChainEdgeInfo(edge.name, stages[k].name, stages[k + 1].name, stages[k].cluster, stages[k + 1].cluster)
        for k, edge in enumerate(job.spec.edges)
    ]


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
    # Each cluster's switch links, by peer cluster: {cluster: {peer: {connected, identity, ...}}}.
    links: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    # Last edge counters each stage reported (bytes_sent, raw_bytes_sent), by stage, upstream first.
    stage_traffic: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Encoded bytes both stages' edges had sent when each loss step was reported (WAN use per step).
    wan_bytes_per_step: list[int] = field(default_factory=list)
    loss_stage: str = ""  # the stage that owns the loss (reports `loss`)
    # Each stage's last per-edge counters (``StageStatus.edges``): stage -> edge name -> counters.
    edge_traffic: dict[str, dict[str, trainer_pb2.EdgeTraffic]] = field(default_factory=dict)
    # A chain's WAN numbers: edge name -> "forward"/"backward" -> numbers (``fill_chain_wan``).
    wan_edges: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)

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
        """This job's WAN numbers per direction, from the switches' per-job counters (module doc)."""
        src_id, dst_id = source.endpoints.cluster_id, target.endpoints.cluster_id
        for session, other in ((source, dst_id), (target, src_id)):
            cluster = session.endpoints.cluster_id
            statuses = session.link_statuses()
            self.links[cluster] = {peer: link_summary(status) for peer, status in statuses.items()}
            # The identity that matters for this job: the link toward the job's other cluster (a
            # switch with several peers lists them all in ``links``).
            toward = statuses.get(other) or next(iter(statuses.values()))
            self.peer_identities[cluster] = toward.verified_peer_identity
        counters = settled_job_counters(source, target, self.job_id)
        if counters is None:
            self._fill_wan_from_stages(src_id, dst_id)
            return
        by_cluster = {src_id: counters[0], dst_id: counters[1]}
        for direction, sender, receiver in (("forward", src_id, dst_id), ("backward", dst_id, src_id)):
            sent = by_cluster[sender]["sent"]
            payload, raw = sent["payload_bytes"], sent["raw_bytes"]
            self.wan[direction] = {
                "from": sender,
                "to": receiver,
                "counted_by": "switches",
                "bytes": sent["bytes"],
                "payload_bytes": sent["payload_bytes"],
                "raw_bytes": sent["raw_bytes"],
                "frames": sent["frames"],
                "bytes_received_by_peer": by_cluster[receiver]["received"]["bytes"],
                "prometheus_bytes": sent["bytes"],
                "compression_ratio": raw / payload if payload else 0.0,
                "wire_ratio": (sent["raw_bytes"] / sent["bytes"]) if sent["bytes"] else 0.0,
                "seconds": self.train_seconds,
            }

    def _fill_wan_from_stages(self, src_id: str, dst_id: str) -> None:
        """Without switch metrics: the stages' own edge counters (payload bytes, per job)."""
        stages = list(self.stage_traffic.items())
        for (direction, sender, receiver), (_, (payload, raw)) in zip(
            (("forward", src_id, dst_id), ("backward", dst_id, src_id)), stages, strict=False
        ):
            self.wan[direction] = {
                "from": sender,
                "to": receiver,
                "counted_by": "trainers",
                "payload_bytes": payload,
                "raw_bytes": raw,
                "compression_ratio": raw / payload if payload else 0.0,
                "seconds": self.train_seconds,
            }

    def fill_chain_wan(
        self, edges: list[ChainEdgeInfo], sessions: dict[str, ClusterSession] | None = None
    ) -> None:
        """A chain's WAN numbers per edge and direction.

        With ``sessions`` (cluster -> session) whose switches expose metrics: the switches' per-job,
        per-peer series, as a two-stage job's (``counted_by: switches``, wire bytes too). Otherwise
        the stages' own per-edge counters: edge K's forward numbers are what stage K sent on it, its
        backward numbers what stage K+1 sent back, each with the receiving side's counts beside them.
        """
        for edge in edges:
            if sessions is not None and self._fill_edge_from_switches(edge, sessions):
                continue
            ends = {
                stage: self.edge_traffic.get(stage, {}).get(edge.name, trainer_pb2.EdgeTraffic())
                for stage in (edge.from_stage, edge.to_stage)
            }
            directions = (
                ("forward", edge.from_stage, edge.to_stage, edge.from_cluster, edge.to_cluster),
                ("backward", edge.to_stage, edge.from_stage, edge.to_cluster, edge.from_cluster),
            )
            self.wan_edges[edge.name] = {}
            for direction, sender, receiver, source, target in directions:
                sent, got = ends[sender], ends[receiver]
                self.wan_edges[edge.name][direction] = {
                    "from": source,
                    "to": target,
                    "counted_by": "trainers",
                    "payload_bytes": sent.bytes_sent,
                    "raw_bytes": sent.raw_bytes_sent,
                    "frames": sent.frames_sent,
                    "payload_bytes_received_by_peer": got.bytes_received,
                    "frames_received_by_peer": got.frames_received,
                    "compression_ratio": sent.raw_bytes_sent / sent.bytes_sent if sent.bytes_sent else 0.0,
                    "seconds": self.train_seconds,
                }

    def _fill_edge_from_switches(self, edge: ChainEdgeInfo, sessions: dict[str, ClusterSession]) -> bool:
        source, target = sessions[edge.from_cluster], sessions[edge.to_cluster]
        counters = settled_job_counters(source, target, self.job_id, per_peer=True)
        if counters is None:
            return False
        by_cluster = {edge.from_cluster: counters[0], edge.to_cluster: counters[1]}
        self.wan_edges[edge.name] = {}
        for direction, sender, receiver in (
            ("forward", edge.from_cluster, edge.to_cluster),
            ("backward", edge.to_cluster, edge.from_cluster),
        ):
            sent = by_cluster[sender]["sent"]
            payload, raw = sent["payload_bytes"], sent["raw_bytes"]
            self.wan_edges[edge.name][direction] = {
                "from": sender,
                "to": receiver,
                "counted_by": "switches",
                "bytes": sent["bytes"],
                "payload_bytes": payload,
                "raw_bytes": raw,
                "frames": sent["frames"],
                "bytes_received_by_peer": by_cluster[receiver]["received"]["bytes"],
                "compression_ratio": raw / payload if payload else 0.0,
                "wire_ratio": raw / sent["bytes"] if sent["bytes"] else 0.0,
                "seconds": self.train_seconds,
            }
        return True

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "steps": self.steps_done,
            "steps_requested": self.steps,
            "succeeded": self.succeeded,
            "stage_states": self.stage_states,
            "stage_messages": self.stage_messages,
            "loss_per_step": self.losses,
            "step_seconds_per_step": self.step_seconds,
            "wan_bytes_per_step": self.wan_bytes_per_step,
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
            **({"wan_edges": self.wan_edges} if self.wan_edges else {}),
            "peer_identities": self.peer_identities,
            "links": self.links,
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
    summary.stage_traffic = dict.fromkeys(handle.stages, (0, 0))  # upstream first, as submitted
    started = time.perf_counter()
    last_step: dict[str, int] = {}
    sent: dict[str, int] = {}
    for update in handle.updates():
        status = update.status
        stage = status.stage
        sent[stage] = status.bytes_sent
        if on_status is not None:
            on_status(status)
        summary.stage_states[stage] = trainer_pb2.StageState.Name(status.state).removeprefix("STAGE_STATE_")
        summary.stage_messages[stage] = status.message
        if status.bytes_sent or status.raw_bytes_sent:
            summary.stage_traffic[stage] = (status.bytes_sent, status.raw_bytes_sent)
        if status.edges:
            summary.edge_traffic[stage] = {traffic.edge: traffic for traffic in status.edges}
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
                summary.wan_bytes_per_step.append(sum(sent.values()))
                summary.loss_stage = stage
                if on_step is not None:
                    on_step(status)
    summary.train_seconds = time.perf_counter() - started
    return summary
