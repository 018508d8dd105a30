"""A 3-stage job across three real clusters a -> b -> c: switches, trainers and auth, over mTLS.

Each cluster runs its own auth service, switch and trainer in this process (``ServiceThread``s),
and clusters a and b a codec service (the sending clusters of the two edges, for ``codec: auto``);
switch b links to both a and c (``tests/support/switch_mesh.py``), a and c only to b. The job
(``examples/chain``, small) is submitted through the SDK (``submit_job``: each stage to its own
cluster's trainer with that cluster's token). With codec ``none`` and a fixed seed it must equal
the unsplit model trained in this process: every per-step loss, and the final checkpoint each
trainer wrote of its stage (1e-5). Every edge crosses its own WAN link: b's switch relayed
frames to and from both a and c. With the example's lossy codecs (fp16 on a-b, int8 on b-c) it trains
to within 2% of the unsplit model's loss. With ``auto`` on both edges, each edge is advised by its sending
cluster's codec service for its own link, every stage runs and reports the per-edge choice, and
the summary has each edge's WAN numbers per direction.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from nebula_common.clients.endpoints import ClusterEndpoints
from nebula_common.jobspec import load_spec
from nebula_common.jobspec.reference import run_unsplit
from nebula_common.pki import PkiLayout, init_pki
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.client import ClusterSession, submit_job
from nebula_common.sdk.codec_advice import LinkProfile
from nebula_common.sdk.jobs import ProgramJob
from nebula_common.sdk.summary import chain_edges, summarize
from services.codec.config import CodecSettings
from services.codec.server import SERVICE as CODEC_SERVICE
from services.trainer.config import TrainerSettings
from services.trainer.server import SERVICE as TRAINER_SERVICE
from services.trainer.servicer import TrainerServicer
from tests.support.service_thread import ServiceThread
from tests.support.switch_mesh import CHAIN, Chain, switch_chain

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "chain" / "job.yaml"
STEPS = 6


@pytest.fixture(scope="module")
def pki_abc(tmp_path_factory: pytest.TempPathFactory) -> PkiLayout:
    return init_pki(tmp_path_factory.mktemp("pki"), list(CHAIN))


@pytest.fixture(scope="module")
def clusters(
    tmp_path_factory: pytest.TempPathFactory, pki_abc: PkiLayout
) -> Iterator[tuple[Chain, dict[str, ServiceThread[TrainerServicer]], Path]]:
    work = tmp_path_factory.mktemp("chain")
    with ExitStack() as stack:
        chain = stack.enter_context(switch_chain(work, pki_abc))
        trainers = {}
        for cluster in CHAIN:
            settings = TrainerSettings(
                cluster_id=cluster,
                switch_address=chain.switches[cluster].internal_address,
                auth_address=chain.auths[cluster].address,
                data_dir=work / cluster / "trainer",
                metrics_port=-1,
                stop_grace_s=5.0,
                torch_threads=torch.get_num_threads(),  # the trainer sets it process-wide: keep ours
            )
            trainers[cluster] = ServiceThread(TRAINER_SERVICE, settings, timeout=30)
            stack.callback(trainers[cluster].stop)
        yield chain, trainers, work


@pytest.fixture(scope="module")
def codecs(
    clusters: tuple[Chain, dict[str, ServiceThread[TrainerServicer]], Path],
) -> Iterator[dict[str, str]]:
    """Codec services of a and b (the edges' sending clusters), one calibration cache for this host."""
    chain, _, work = clusters
    with ExitStack() as stack:
        addresses = {}
        for cluster in ("a", "b"):
            settings = CodecSettings(
                cluster_id=cluster,
                auth_address=chain.auths[cluster].address,
                calibration_cache=str(work / "codec-calibration.json"),
                torch_threads=torch.get_num_threads(),  # the service sets it process-wide: keep ours
                metrics_port=-1,
            )
            service = ServiceThread(CODEC_SERVICE, settings, timeout=60)
            stack.callback(service.stop)
            addresses[cluster] = service.address
        yield addresses


def sessions_of(
    chain: Chain, trainers: dict[str, ServiceThread[TrainerServicer]], codecs: dict[str, str] | None = None
) -> dict[str, ClusterSession]:
    return {
        cluster: ClusterSession(
            ClusterEndpoints(
                cluster_id=cluster,
                auth=chain.auths[cluster].address,
                trainer=trainers[cluster].address,
                switch=chain.switches[cluster].internal_address,
                codec=(codecs or {}).get(cluster, ""),
            ),
            chain.tokens[cluster],
            "admin",
        )
        for cluster in CHAIN
    }


def run_to_the_end(job: ProgramJob, sessions: dict[str, ClusterSession]) -> dict[int, float]:
    """Submit the job, follow it to its end, and return the head's loss per step (all stages succeeded)."""
    handle = submit_job(job, sessions)
    losses: dict[int, float] = {}
    for update in handle.updates():
        if update.status.stage == "head" and update.status.HasField("loss"):
            losses[int(update.status.steps_done) - 1] = update.status.loss
    finals = {stage: status for stage, status in handle.final.items()}
    assert {stage: trainer_pb2.StageState.Name(s.state) for stage, s in finals.items()} == {
        "reader": "STAGE_STATE_SUCCEEDED",
        "mixer": "STAGE_STATE_SUCCEEDED",
        "head": "STAGE_STATE_SUCCEEDED",
    }, {stage: s.message for stage, s in finals.items()}
    return losses


def test_a_three_cluster_chain_over_real_switches_equals_the_unsplit_model(
    clusters: tuple[Chain, dict[str, ServiceThread[TrainerServicer]], Path],
) -> None:
    chain, trainers, work = clusters
    overrides = {
        "steps": STEPS,
        "checkpoint.interval": 2,
        "edges.0.codec.forward": "none",
        "edges.0.codec.backward": "none",
        "edges.1.codec.forward": "none",
        "edges.1.codec.backward": "none",
    }
    job = ProgramJob(load_spec(EXAMPLE, overrides))
    sessions = sessions_of(chain, trainers)
    b = chain.switches["b"].running
    frames_before = {peer: b.links.get(peer).sent.to_proto().frames for peer in ("a", "c")}  # type: ignore[union-attr]
    losses = run_to_the_end(job, sessions)
    reference = run_unsplit(job.loaded)
    assert sorted(losses) == list(range(STEPS))
    for step in range(STEPS):
        assert losses[step] == pytest.approx(reference.losses[step], abs=1e-5), step
    for stage, cluster in job.clusters().items():  # the final checkpoint each trainer wrote
        model = work / cluster / "trainer" / "accounts" / "admin" / "jobs" / job.job_id / stage
        state = torch.load(model / f"step-{STEPS}" / "model.pt", weights_only=True)
        for key, value in reference.state_dicts[stage].items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=1e-5)
    # Each edge crossed its own link: b relayed gradients to a and activations to c.
    for peer in ("a", "c"):
        link = b.links.get(peer)
        assert link is not None
        assert link.sent.to_proto().frames - frames_before[peer] >= STEPS * 2, peer
    for session in sessions.values():
        session.close()


@pytest.mark.long  # a chain job and an unsplit run (`make test-faults`)
def test_a_lossy_codec_on_each_edge_trains_to_within_two_percent_of_the_unsplit_loss(
    clusters: tuple[Chain, dict[str, ServiceThread[TrainerServicer]], Path],
) -> None:
    """The example's own codecs (fp16 on a-b, int8 on b-c, both directions) over real switches: the
    chain still learns, and its loss stays within 2% of the unsplit model's at every late step."""
    chain, trainers, _ = clusters
    steps = 12
    job = ProgramJob(load_spec(EXAMPLE, {"steps": steps, "checkpoint.interval": 6}))
    assert job.edge_codecs() == [("fp16", "fp16"), ("int8", "int8")]  # lossy both ways on both edges
    sessions = sessions_of(chain, trainers)
    losses = run_to_the_end(job, sessions)
    reference = run_unsplit(job.loaded)
    assert sorted(losses) == list(range(steps))
    assert losses[steps - 1] < losses[0], losses  # it trains
    late = range(steps - 4, steps)
    lossy = sum(losses[step] for step in late) / len(late)
    exact = sum(reference.losses[step] for step in late) / len(late)
    assert abs(lossy - exact) <= 0.02 * exact, (lossy, exact)
    assert any(losses[step] != reference.losses[step] for step in late), "the codecs changed nothing"
    for session in sessions.values():
        session.close()


@pytest.mark.long  # auto's probe, advice and a chain job (`make test-faults`)
def test_auto_on_a_three_cluster_chain_is_advised_per_edge_and_each_edge_has_its_wan_numbers(
    clusters: tuple[Chain, dict[str, ServiceThread[TrainerServicer]], Path], codecs: dict[str, str]
) -> None:
    chain, trainers, _ = clusters
    steps = 4
    overrides = {"steps": steps, "checkpoint.interval": 2}
    for index in (0, 1):
        overrides |= {f"edges.{index}.codec.forward": "auto", f"edges.{index}.codec.backward": "auto"}
    job = ProgramJob(load_spec(EXAMPLE, overrides))
    sessions = sessions_of(chain, trainers, codecs)
    links = {
        "reader->mixer": LinkProfile(bandwidth_mbit=0.1, rtt_ms=20.0),  # slow links: compressing wins
        "mixer->head": LinkProfile(bandwidth_mbit=0.05, rtt_ms=40.0),
    }
    # Stated, not measured: links slower than these unshaped loopback ones (measured links:
    # test_chain_measured_links.py).
    handle = submit_job(job, sessions, links=links, measure_links=False)
    summary = summarize(job, handle)
    assert summary.succeeded, summary.stage_messages
    choice = json.loads(job.codec_choice)
    assert choice["source"] == "per-edge"
    codecs_per_edge = job.edge_codecs()
    for record, (name, link), pair in zip(choice["edges"], links.items(), codecs_per_edge, strict=True):
        assert record["edge"] == name and (record["forward"], record["backward"]) == pair
        assert record["link"] == {"bandwidth_mbit": link.bandwidth_mbit, "rtt_ms": link.rtt_ms}
        assert record["trial"]["reasons"][-1].startswith("chose"), record["trial"]["reasons"]
    assert "auto" not in {codec for pair in codecs_per_edge for codec in pair}
    finals = handle.final
    assert {final.codec_choice for final in finals.values()} == {job.codec_choice}  # every stage reports it
    assert (finals["reader"].codec_forward, finals["reader"].codec_backward) == codecs_per_edge[0]
    assert (finals["head"].codec_forward, finals["head"].codec_backward) == codecs_per_edge[1]
    summary.fill_chain_wan(chain_edges(job))
    frames = steps * job.spec.data.micro_batches
    for name, (source, target) in zip(links, (("a", "b"), ("b", "c")), strict=True):
        for direction, ends in (("forward", (source, target)), ("backward", (target, source))):
            wan = summary.wan_edges[name][direction]
            assert (wan["from"], wan["to"], wan["frames"]) == (*ends, frames), (name, direction, wan)
            assert wan["payload_bytes"] == wan["payload_bytes_received_by_peer"] > 0, (name, direction, wan)
    for session in sessions.values():
        session.close()
