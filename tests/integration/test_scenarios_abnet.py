"""ABNet-cloud on real Spanish->English text, on the real two-cluster deployment (gRPC, emulated WAN).

Pre-train (one_way job) -> fine-tune with frozen PLMs + adapters (backprop job, states S->T, gradients
T->S) -> greedy decoding across the clusters and BLEU in T. Small sizes: this checks the mechanics
(frozen stays frozen, adapters train, decoding returns strings, BLEU is finite); BLEU values live in
bench/runtime/abnet_bleu.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from nebula_common.jobspec import load_spec
from nebula_common.jobspec.builtin import BUILTIN_DIR
from nebula_common.launcher import LocalDeployment
from nebula_common.sdk.client import ClusterSession, submit_job
from nebula_common.sdk.jobs import ProgramJob
from nebula_common.sdk.summary import summarize
from nebula_common.zoo.text_data import split_pairs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
SMALL = {
    "steps": 3,
    "data.batch_size": 16,
    **{f"stages.{i}.options.{k}": v for i in (0, 1) for k, v in {"d_model": 32, "n_layers": 1}.items()},
}


def stage_file(deployment: LocalDeployment, job: ProgramJob, stage: str, name: str) -> Path:
    cluster = job.clusters()[stage]
    found = sorted((deployment.run_dir / cluster).glob(f"**/jobs/{job.job_id}/{stage}/{name}"))
    assert found, f"no {name} of {stage} in cluster {cluster}"
    return found[0]


@pytest.mark.long  # pre-trains and fine-tunes ABNet (`make test-faults`)
def test_pretrain_finetune_and_cross_cluster_bleu(
    deployment: LocalDeployment, sessions: dict[str, ClusterSession]
) -> None:
    pretrain = ProgramJob(load_spec(BUILTIN_DIR / "abnet" / "pretrain.yaml", SMALL))
    summary = summarize(pretrain, submit_job(pretrain, sessions))
    assert summary.succeeded, summary.stage_messages
    plm = {s: stage_file(deployment, pretrain, s, "step-3/model.pt") for s in ("encoder", "decoder")}

    overrides = {**SMALL, **{f"stages.{i}.options.pretrained": str(plm[s]) for i, s in enumerate(plm)}}
    job = ProgramJob(load_spec(BUILTIN_DIR / "abnet" / "job.yaml", overrides))
    summary = summarize(job, submit_job(job, sessions))
    assert summary.succeeded, summary.stage_messages
    assert all(math.isfinite(x) for x in summary.losses)
    for stage in ("encoder", "decoder"):
        pretrained = torch.load(plm[stage], weights_only=True)
        tuned = torch.load(stage_file(deployment, job, stage, "step-3/model.pt"), weights_only=True)
        for name, value in pretrained.items():  # frozen: bit-identical after real split training
            assert torch.equal(tuned[f"plm.{name}"], value), name
        adapters = [k for k in tuned if not k.startswith("plm.")]
        assert any(tuned[k].abs().sum() > 0 for k in adapters if k.endswith("up.weight"))  # zero at init

    record = json.loads(stage_file(deployment, job, "decoder", "eval.json").read_text())
    _, held = split_pairs(10)
    assert record["examples"] == len(held) == len(record["outputs"])
    assert all(isinstance(text, str) for text in record["outputs"])
    assert math.isfinite(record["metrics"]["bleu"])
    assert not list((deployment.run_dir / "a").glob(f"**/jobs/{job.job_id}/**/eval.json"))  # BLEU stays in T


@pytest.mark.long  # in `make test-faults`; `make test` keeps the pretrain-finetune scenario above
@pytest.mark.timeout(420)  # two jobs with evaluation: ~25 s on an idle host; 240 s ran out once at load 20
def test_learned_bottleneck_shrinks_both_directions_by_d_over_k_on_the_wire(
    deployment: LocalDeployment, sessions: dict[str, ClusterSession]
) -> None:
    """Same job with and without ``cut_k``: the switches count k/d of the raw bytes each way, exactly."""
    d_model, k = SMALL["stages.0.options.d_model"], 4
    raw: dict[int, dict[str, int]] = {}
    for cut_k in (0, k):
        overrides = {**SMALL, **{f"stages.{i}.options.cut_k": cut_k for i in (0, 1)}}
        job = ProgramJob(load_spec(BUILTIN_DIR / "abnet" / "job.yaml", overrides))
        summary = summarize(job, submit_job(job, sessions))
        assert summary.succeeded, summary.stage_messages
        summary.fill_wan(sessions["a"], sessions["b"])
        assert summary.wan["forward"]["counted_by"] == "switches"
        raw[cut_k] = {d: summary.wan[d]["raw_bytes"] for d in ("forward", "backward")}
        if cut_k:
            state = torch.load(stage_file(deployment, job, "encoder", "step-3/model.pt"), weights_only=True)
            assert tuple(state["down.proj.weight"].shape) == (k, d_model)  # in the stage's checkpoint
    for direction in ("forward", "backward"):
        assert raw[0][direction] > 0
        assert raw[k][direction] * d_model == raw[0][direction] * k, (direction, raw)


@pytest.mark.long
@pytest.mark.timeout(480)  # two tiny HF models saved, a 3-step job, a refusal; transformers loads slowly
def test_abnet_from_two_local_hf_directories_and_a_broken_one_refused_by_the_trainer(
    deployment: LocalDeployment, sessions: dict[str, ClusterSession], shared_dir: Path
) -> None:
    """The encoder and decoder come from HF-format folders (tiny BERT and GPT-2, save_pretrained).

    Frozen weights come out of real split training bit-identical to the saved safetensors; a folder
    without weights, named by an absolute path (the cluster's, unchecked by the submitter), is refused
    by the trainer's validation naming the option and the path, and no stage is left running.
    """
    from safetensors.torch import load_file

    from nebula_common.errors import NebulaError
    from nebula_common.sdk.job_records import list_stage_infos
    from tests.unit.test_pretrained_dirs import D_MODEL, _save_models

    root = shared_dir / "abnet-hf"  # what the trainers see besides their own (`local up --share`)
    dirs = _save_models(root)
    for path in [root, *root.rglob("*")]:  # safetensors writes 0600: a root launcher's trainer is 47000
        path.chmod(0o755 if path.is_dir() else 0o644)
    options = {"d_model": D_MODEL, "n_layers": 2, "bottleneck": 16}
    overrides = {
        **SMALL,
        **{f"stages.{i}.options.{k}": v for i in (0, 1) for k, v in options.items()},
        "stages.0.options.encoder_dir": str(dirs["encoder"]),
        "stages.1.options.decoder_dir": str(dirs["decoder"]),
    }
    job = ProgramJob(load_spec(BUILTIN_DIR / "abnet" / "job.yaml", overrides))
    summary = summarize(job, submit_job(job, sessions))
    assert summary.succeeded, summary.stage_messages
    for stage in ("encoder", "decoder"):
        tuned = torch.load(stage_file(deployment, job, stage, "step-3/model.pt"), weights_only=True)
        saved = load_file(str(dirs[stage] / "model.safetensors"))
        frozen = [name for name in saved if f"model.{name}" in tuned]
        assert len(frozen) >= len(saved) - 1, (stage, len(frozen), len(saved))
        for name in frozen:
            assert torch.equal(tuned[f"model.{name}"], saved[name]), name

    (dirs["encoder"] / "model.safetensors").unlink()
    broken = ProgramJob(load_spec(BUILTIN_DIR / "abnet" / "job.yaml", overrides))
    with pytest.raises(NebulaError) as refused:
        submit_job(broken, sessions)
    message = str(refused.value)
    assert f"program.options.encoder_dir: {dirs['encoder']}: no model.safetensors" in message, message
    for session in sessions.values():  # refused before any cluster started a stage of it
        assert not list_stage_infos(session, broken.job_id), session.endpoints.cluster_id
