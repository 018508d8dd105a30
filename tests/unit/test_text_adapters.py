"""ABNet adapters: pre-trained weights stay frozen while adapters train; decoding yields strings."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from nebula_common.jobspec import load_spec
from nebula_common.jobspec.builtin import BUILTIN_DIR
from nebula_common.jobspec.reference import build_programs, run_unsplit, save_state_dicts

SMALL = {
    "steps": 3,
    "data.batch_size": 16,
    **{f"stages.{i}.options.{k}": v for i in (0, 1) for k, v in {"d_model": 32, "n_layers": 1}.items()},
}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    job = load_spec(BUILTIN_DIR / "abnet" / "pretrain.yaml", SMALL)
    result = run_unsplit(job)
    assert all(math.isfinite(x) for x in result.losses + result.local_losses)
    return save_state_dicts(result, tmp_path_factory.mktemp("pretrained"))


def test_frozen_pretrained_weights_do_not_change_while_adapters_do(pretrained: dict[str, Path]) -> None:
    overrides = {f"stages.{i}.options.pretrained": str(pretrained[s]) for i, s in enumerate(pretrained)}
    job = load_spec(BUILTIN_DIR / "abnet" / "job.yaml", {**SMALL, **overrides})
    before = {
        stage: {k: v.clone() for k, v in m.model.state_dict().items()}
        for stage, m in zip(("encoder", "decoder"), build_programs(job), strict=True)
    }
    after = run_unsplit(job).state_dicts
    for stage in ("encoder", "decoder"):
        plm = torch.load(pretrained[stage], weights_only=True)
        for name, value in plm.items():
            torch.testing.assert_close(before[stage][f"plm.{name}"], value, rtol=0, atol=0)
            torch.testing.assert_close(after[stage][f"plm.{name}"], value, rtol=0, atol=0)
        adapters = [k for k in after[stage] if not k.startswith("plm.")]
        assert adapters and any(not torch.equal(before[stage][k], after[stage][k]) for k in adapters)


def test_greedy_decoding_and_bleu_on_held_out_pairs(pretrained: dict[str, Path]) -> None:
    job = load_spec(BUILTIN_DIR / "abnet" / "job.yaml", SMALL)
    source, target = build_programs(job)
    spanish = source.module.load_eval_examples(source.options)[:8]
    english = target.module.load_eval_examples(target.options)[:8]
    with torch.no_grad():
        memory = source.forward(source.module.collate(spanish))
    assert (memory[torch.tensor(spanish) == 0] == 0).all()  # padding rows are exact zeros
    hypotheses = target.module.decode(target.model, memory, target.module.collate(english))
    assert len(hypotheses) == 8 and all(isinstance(h, str) for h in hypotheses)
    metrics = target.module.score(hypotheses, english)
    assert math.isfinite(metrics["bleu"]) and 0 <= metrics["bleu"] <= 100


def test_a_checkpoint_of_another_shape_is_refused(pretrained: dict[str, Path]) -> None:
    overrides = {
        **SMALL,
        "stages.0.options.d_model": 64,
        "stages.0.options.pretrained": str(pretrained["encoder"]),
    }
    with pytest.raises(Exception, match="pretrained checkpoint"):
        build_programs(load_spec(BUILTIN_DIR / "abnet" / "job.yaml", overrides))


def test_the_score_is_blind_to_case_in_bleu_and_chrf_alike() -> None:
    """The tokenizer lower-cases the output: a cased reference must not cost chrF every capital letter."""
    from nebula_common.jobspec.builtin.abnet import target

    references = [("Log out of the Site.", [1]), ("Change Password", [1])]
    lowered = target.score(["log out of the site.", "change password"], references)
    assert lowered["bleu"] == pytest.approx(100) and lowered["chrf"] == pytest.approx(100)
    assert lowered["exact_match"] == 1.0
    wrong = target.score(["log in to the site.", "change password"], references)
    assert wrong["chrf"] < 90  # the metric still reads the words
