"""ABNet from two local Hugging Face-format directories: loaded offline, frozen as saved, checked up front.

Tiny real models (a BERT encoder, a GPT-2 causal LM) are built from a config and written with
``save_pretrained``; a job spec names them relative to itself. A missing directory, a missing file or
weights that do not fit the config (or the stage's options) is a spec error naming the option and the
path, both where the spec is loaded and in the trainer's validation of the StageSpec.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from nebula_common.errors import InvalidRequestError
from nebula_common.jobspec import SpecError, load_spec
from nebula_common.jobspec.builtin import BUILTIN_DIR
from nebula_common.jobspec.reference import build_programs, run_unsplit
from nebula_common.sdk.jobs import ProgramJob
from services.trainer.validation import validate_stage_spec

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

D_MODEL, VOCAB, LENGTH = 32, 1000, 24


def _save_models(root: Path) -> dict[str, Path]:
    torch.manual_seed(7)
    encoder = transformers.BertModel(
        transformers.BertConfig(
            vocab_size=VOCAB + 24,
            hidden_size=D_MODEL,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=32,
        )
    )
    decoder = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=D_MODEL,
            n_layer=2,
            n_head=4,
            n_positions=32,
            bos_token_id=1,
            eos_token_id=2,
        )
    )
    dirs = {"encoder": root / "models" / "es-bert", "decoder": root / "models" / "en-gpt2"}
    encoder.save_pretrained(dirs["encoder"])
    decoder.save_pretrained(dirs["decoder"])
    return dirs


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _save_models(tmp_path_factory.mktemp("hf"))


def _write_spec(folder: Path, encoder_dir: str, decoder_dir: str) -> Path:
    spec = yaml.safe_load((BUILTIN_DIR / "abnet" / "job.yaml").read_text())
    spec.update(steps=3, data={**spec["data"], "batch_size": 16})
    for stage, option, value in zip(
        spec["stages"], ("encoder_dir", "decoder_dir"), (encoder_dir, decoder_dir), strict=True
    ):
        stage["module"] = str(BUILTIN_DIR / "abnet" / stage["module"])
        stage["options"].update({"d_model": D_MODEL, "n_layers": 2, "bottleneck": 16, option: value})
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_abnet_starts_from_two_local_hf_directories_named_relative_to_the_spec(
    saved: dict[str, Path],
) -> None:
    root = saved["encoder"].parents[1]
    job = load_spec(_write_spec(root, "models/es-bert", "models/en-gpt2"))
    options = [stage.options for stage in job.spec.stages]
    assert options[0]["encoder_dir"] == str(saved["encoder"].resolve())
    assert options[1]["decoder_dir"] == str(saved["decoder"].resolve())
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # set by the first check, before transformers loads a model

    source, target = build_programs(job)
    for program, stage, prefix in ((source, "encoder", "model."), (target, "decoder", "model.")):
        params = dict(program.model.named_parameters())
        saved_weights = load_file(str(saved[stage] / "model.safetensors"))
        checked = 0
        for name, value in saved_weights.items():
            if prefix + name in params:
                parameter = params[prefix + name]
                torch.testing.assert_close(parameter.detach(), value, rtol=0, atol=0)
                assert not parameter.requires_grad, f"{stage}: {name} must stay frozen"
                checked += 1
        assert checked >= len(saved_weights) - 1, f"{stage}: only {checked} of {len(saved_weights)} compared"
        trainable = [n for n, p in params.items() if p.requires_grad]
        assert trainable and all("nebula_adapter" in n for n in trainable), trainable

    # The job trains: frozen weights stay bit-exact, adapters move, losses are finite.
    result = run_unsplit(job)
    assert len(result.losses) == 3 and all(math.isfinite(x) for x in result.losses)
    after = result.state_dicts["encoder"]
    for name, value in load_file(str(saved["encoder"] / "model.safetensors")).items():
        if f"model.{name}" in after:
            torch.testing.assert_close(after[f"model.{name}"], value, rtol=0, atol=0)
    before = dict(source.model.state_dict())
    assert any(not torch.equal(before[k], v) for k, v in after.items() if "nebula_adapter" in k)


def _copy(saved: dict[str, Path], root: Path) -> dict[str, Path]:
    dirs = {}
    for stage, path in saved.items():
        dirs[stage] = root / "models" / path.name
        shutil.copytree(path, dirs[stage])
    return dirs


def _refusals(spec_path: Path, encoder_dir: str) -> tuple[str, str]:
    """(the spec loader's error, the trainer validation's error) for a broken encoder directory."""
    with pytest.raises(SpecError) as at_load:
        load_spec(spec_path)
    # The trainer gets an absolute path (as the submitter resolves it) and checks it in its cluster.
    spec = yaml.safe_load(spec_path.read_text())
    spec["stages"][0]["options"]["encoder_dir"] = ""
    good = ProgramJob(load_spec(spec, base_dir=spec_path.parent), "job-1")
    stage_spec = good.stage_spec("encoder")
    options: dict[str, Any] = json.loads(stage_spec.program.options_json)
    options["encoder_dir"] = str((spec_path.parent / encoder_dir).resolve())
    stage_spec.program.options_json = json.dumps(options)
    with pytest.raises(InvalidRequestError) as at_trainer:
        validate_stage_spec(stage_spec)
    return str(at_load.value), str(at_trainer.value)


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        ("no-dir", "no such directory"),
        ("no-weights", "no model.safetensors"),
        ("no-config", "no config.json"),
        ("shapes", "weights do not match config.json"),
        ("width", "config.json has hidden_size=48, the stage's option d_model is 32"),
    ],
)
def test_a_missing_or_mismatched_directory_is_a_spec_error_naming_option_and_path(
    saved: dict[str, Path], tmp_path: Path, breakage: str, expected: str
) -> None:
    dirs = _copy(saved, tmp_path)
    encoder = dirs["encoder"]
    if breakage == "no-dir":
        shutil.rmtree(encoder)
    elif breakage == "no-weights":
        (encoder / "model.safetensors").unlink()
    elif breakage == "no-config":
        (encoder / "config.json").unlink()
    else:
        config = json.loads((encoder / "config.json").read_text())
        if breakage == "shapes":
            config["intermediate_size"] = 80  # the saved feed-forward weights are 64 wide
        else:
            config.update(hidden_size=48, num_attention_heads=4)  # every weight and d_model disagree
        (encoder / "config.json").write_text(json.dumps(config))
    spec_path = _write_spec(tmp_path, "models/es-bert", "models/en-gpt2")
    at_load, at_trainer = _refusals(spec_path, "models/es-bert")
    path = str(encoder.resolve())
    assert f"stages.0.options.encoder_dir: {path}: {expected}" in at_load
    assert f"program.options.encoder_dir: {path}: {expected}" in at_trainer
    assert "Traceback" not in at_load + at_trainer


def test_a_directory_of_the_wrong_kind_of_model_is_refused(saved: dict[str, Path], tmp_path: Path) -> None:
    dirs = _copy(saved, tmp_path)
    # The decoder stage needs a causal LM; a BERT encoder's weights lack its LM head.
    spec_path = _write_spec(tmp_path, "models/es-bert", "models/es-bert")
    with pytest.raises(SpecError, match=r"stages\.1\.options\.decoder_dir: .*es-bert: weights lack"):
        load_spec(spec_path)
    assert dirs
