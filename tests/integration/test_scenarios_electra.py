"""ELECTRA across clusters on the real deployment: one-way ids, per-step sync, data-parallel replicas.

The yardstick is again the unsplit run in this process (``run_unsplit``): the
generator's MLM losses, the discriminator's RTD losses and both stages' final
parameters of the split run, with the discriminator as 2 data-parallel
processes (torch.distributed gloo, DDP), must match one process training the
combined batch. Equality up to float reassociation (the all-reduce sums in a
different order), so the tolerance is 1e-5 relative, not bit-exactness. The
test trains with SGD: attention key biases have a gradient that is exactly zero
in theory and ~1e-10 of rounding noise in practice, which Adam normalises into
full-size steps of random sign, so under Adam two equally correct runs differ.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nebula_common.jobspec import LoadedJob, load_spec
from nebula_common.jobspec.builtin import builtin_spec
from nebula_common.jobspec.reference import run_unsplit
from nebula_common.launcher import LocalDeployment
from nebula_common.sdk.client import ClusterSession, submit_job
from nebula_common.sdk.jobs import ProgramJob
from nebula_common.sdk.summary import summarize

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def electra(**overrides: Any) -> LoadedJob:
    small = {
        "steps": 5,
        "data.batch_size": 32,
        "stages.0.options.d_model": 32,
        "stages.1.options.d_model": 32,
        "stages.1.options.n_layers": 1,
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    }
    return load_spec(builtin_spec("electra"), {**small, **overrides})


def checkpoint(
    deployment: LocalDeployment, job: ProgramJob, stage: str, step: int
) -> dict[str, torch.Tensor]:
    cluster = job.clusters()[stage]
    (path,) = (deployment.run_dir / cluster / "trainer" / "accounts").glob(
        f"*/jobs/{job.job_id}/{stage}/step-{step}/model.pt"
    )
    return torch.load(path, weights_only=True)


@pytest.mark.long  # about 40 s: in `make test-faults` (CI), keeping `make test` under ten minutes
@pytest.mark.parametrize("replicas", [2])
def test_electra_with_replicated_discriminator_equals_the_unsplit_run(
    replicas: int, deployment: LocalDeployment, sessions: dict[str, ClusterSession]
) -> None:
    loaded = electra(**{"stages.1.replicas": replicas})
    reference = run_unsplit(loaded)
    job = ProgramJob(loaded)
    summary = summarize(job, submit_job(job, sessions))
    assert summary.succeeded, summary.stage_messages
    torch.testing.assert_close(
        torch.tensor(summary.losses), torch.tensor(reference.losses), rtol=1e-5, atol=1e-6
    )
    generator_losses = summary.local_losses["generator"]
    torch.testing.assert_close(torch.tensor(generator_losses), torch.tensor(reference.local_losses))
    for stage in ("generator", "discriminator"):
        state = checkpoint(deployment, job, stage, 5)
        assert state.keys() == reference.state_dicts[stage].keys()
        for name, tensor in state.items():
            # Replicas average their gradients by an all-reduce, which sums in another order than one
            # big batch does; Adam divides by sqrt(v) and turns those 1e-7 rounding differences into
            # ~1e-5 parameter differences after 5 steps. Still far below what one wrong step moves.
            torch.testing.assert_close(tensor, reference.state_dicts[stage][name], rtol=1e-4, atol=2e-5)
    assert reference.losses[-1] < reference.losses[0]  # it trained: equality is not of two no-ops
