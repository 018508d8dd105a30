"""A 3-stage job across three real clusters a -> b -> c: switches, trainers and auth, over mTLS.

Each cluster runs its own auth service, switch and trainer in this process (``ServiceThread``s);
switch b links to both a and c (``tests/support/switch_mesh.py``), a and c only to b. The job
(``examples/chain``, small) is submitted through the SDK (``submit_job``: each stage to its own
cluster's trainer with that cluster's token). With codec ``none`` and a fixed seed it must equal
the unsplit model trained in this process: every per-step loss, and the final checkpoint each
trainer wrote of its stage (1e-5). Every edge crosses its own WAN link: b's switch relayed
frames to and from both a and c.
"""

from __future__ import annotations

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
from nebula_common.sdk.jobs import ProgramJob
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
    sessions = {
        cluster: ClusterSession(
            ClusterEndpoints(
                cluster_id=cluster,
                auth=chain.auths[cluster].address,
                trainer=trainers[cluster].address,
                switch=chain.switches[cluster].internal_address,
            ),
            chain.tokens[cluster],
            "admin",
        )
        for cluster in CHAIN
    }
    b = chain.switches["b"].running
    frames_before = {peer: b.links.get(peer).sent.to_proto().frames for peer in ("a", "c")}  # type: ignore[union-attr]
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
