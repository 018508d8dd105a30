"""Table 5's co-trained bottleneck: halves trained with the bottleneck in place, cached, and the row's
fine-tuning (in the benchmark and as the product job) starting from exactly them.

Small and offline: Django's installed catalogues stand in for the fetched corpus, a tiny model for the
benchmark's (the benchmark's numbers live in docs/bench/table5.md).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from nebula_common.jobspec import load_spec
from nebula_common.jobspec.reference import run_unsplit
from nebula_common.zoo.catalogues import clean_pairs, parse_mo
from nebula_common.zoo.splits import split
from nebula_common.zoo.text_data import catalogue_paths

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "table5"))
import cotrain
import job_files
import train

from tests.support.torch_threads import one_torch_thread

pytestmark = pytest.mark.timeout(120)
TINY = train.ModelConfig(d_model=32, n_layers=1, vocab=600, batch=8, pretrain_steps=3, translation_batch=8)
ROW = train.Row(
    "BOTTLENECK(4,JOINT)+INT8",
    "int8",
    "int8",
    cut_k=4,
    down_residual=16,
    up_residual=16,
    cut_pretrain=5,
    cut_cotrain=6,
    control="NONE(+6)",
)
CONTROL = train.Row("NONE(+6)", cut_cotrain=6)
"""ROW's control: none's halves trained as many more steps, without the bottleneck."""


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[train.Prepared, Path]:
    entries = [e for p in catalogue_paths() for e in parse_mo(p.with_suffix(".mo").read_bytes(), str(p))]
    parts = split(clean_pairs(entries, 16), 0.05, 0.1, seed=13)
    cache = tmp_path_factory.mktemp("models")
    with one_torch_thread():
        return train.prepare(parts.train, parts.test, TINY, cache, "django", threads=1), cache


def _states(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in module.state_dict().items()}


def test_co_training_trains_the_whole_model_with_the_bottleneck_once_and_fine_tuning_starts_there(
    prepared: tuple[train.Prepared, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    prep, cache = prepared
    with pytest.raises(ValueError, match=r"BOTTLENECK\(4,JOINT\)\+INT8: its co-trained halves are not"):
        train.Stages(prep, ROW, seed=0)  # never a silent fall-back to the shared halves
    with one_torch_thread():
        start = train.Stages(prep, replace(ROW, cut_cotrain=0), seed=0)  # the calibrated start
        ready = cotrain.with_cut_states(prep, [train.Row("none"), ROW, CONTROL], cache, "django", threads=1)
    key = train.cut_key(ROW)
    assert list(ready.cut_states) == [key, train.cut_key(CONTROL)]  # none trains nothing more
    state = ready.cut_states[key]
    lm = "plm.blocks.0.ff.0.weight"
    for half, module in (("encoder", start.encoder), ("decoder", start.decoder)):
        assert not torch.equal(state[half][lm], module.state_dict()[lm]), f"{half}'s LM did not train"
    assert not torch.equal(state["down"]["proj.weight"], start.down.state_dict()["proj.weight"])
    control = ready.cut_states[train.cut_key(CONTROL)]
    assert not torch.equal(control["encoder"][lm], start.encoder.state_dict()[lm])
    assert not torch.equal(control["encoder"][lm], state["encoder"][lm])  # its own training, no cut
    assert control["down"] == {} and control["up"] == {}
    saved = sorted(p.name for p in cache.iterdir() if p.name.startswith("cotrained-"))
    expected = [f"cotrained-{cotrain.cut_digest(prep, r, 'django')}.pt" for r in (ROW, CONTROL)]
    assert saved == sorted(expected)  # and no .partial left

    def retrained(*_: object) -> None:
        pytest.fail("co-trained again instead of read from the cache")

    monkeypatch.setattr(cotrain, "cotrain", retrained)
    again = cotrain.with_cut_states(prep, [ROW], cache, "django", threads=1)
    stages = train.Stages(again, ROW, seed=1)
    for name, module in (("encoder", stages.encoder), ("decoder", stages.decoder), ("down", stages.down)):
        for field, value in module.state_dict().items():
            assert torch.equal(value, state[name][field]), (name, field)
    frozen = [name for name, p in stages.encoder.named_parameters() if not p.requires_grad]
    assert frozen and all(name.startswith("plm.") for name in frozen)  # fine-tuning: the LMs frozen again
    with one_torch_thread():
        result = train.fine_tune(again, ROW, 0, steps=2, eval_pairs=8)
        controlled = train.Stages(ready, CONTROL, seed=1)
    for name, value in controlled.decoder.state_dict().items():
        assert torch.equal(value, control["decoder"][name]), name
    assert all(loss == loss for loss in result.losses) and 0 <= result.bleu <= 100


def test_the_product_job_of_a_co_trained_row_starts_from_that_rows_halves_and_bottleneck(
    prepared: tuple[train.Prepared, Path], tmp_path: Path
) -> None:
    prep, cache = prepared
    with one_torch_thread():
        ready = cotrain.with_cut_states(prep, [ROW, CONTROL], cache, "django", threads=1)
    state = ready.cut_states[train.cut_key(ROW)]
    files = job_files.stage_files(ready, [ROW, CONTROL])
    placed = {}
    for cluster, held in files.items():
        (tmp_path / cluster).mkdir()
        placed[cluster] = job_files.place(tmp_path / cluster, held)
    overrides = job_files.job_overrides(ROW, placed, steps=2, micro_batches=1, examples=len(prep.train_es))
    assert overrides["stages.0.options.weights"] != placed["a"]["encoder.pt"]  # the row's own halves
    control = job_files.job_overrides(CONTROL, placed, steps=2, micro_batches=1, examples=1)
    assert control["stages.1.options.weights"] == placed["b"][f"decoder-{train.cut_key(CONTROL)}.pt"]
    assert not any(key.endswith(("cut_init", "cut_k")) for key in control)  # no bottleneck, no halves file
    for index in (0, 1):
        overrides[f"stages.{index}.options.d_model"] = TINY.d_model
    overrides["data.batch_size"] = 8
    with one_torch_thread():
        result = run_unsplit(load_spec(job_files.JOB, overrides))
    assert len(result.losses) == 2 and all(loss == loss for loss in result.losses)
    encoder, decoder = result.state_dicts["encoder"], result.state_dicts["decoder"]
    lm = "plm.blocks.0.ff.0.weight"
    assert torch.equal(encoder[f"encoder.{lm}"], state["encoder"][lm])  # loaded, then frozen
    assert torch.equal(decoder[f"decoder.{lm}"], state["decoder"][lm])
    assert encoder["down.proj.weight"].shape == state["down"]["proj.weight"].shape


def test_a_co_trained_row_is_judged_against_its_control_as_well_as_none() -> None:
    import checks
    import report as reporting

    references = [f"open the file number {i} in folder {i % 7} now" for i in range(60)]

    def row(label: str, wrong_every: int, control: str = "") -> dict:
        out = [("close it" if wrong_every and i % wrong_every == 0 else r) for i, r in enumerate(references)]
        return {"label": label, "hypotheses": [out, out], "final_loss": [1.0, 1.0], "control": control}

    joint = row("BOTTLENECK(16,JOINT)+INT8", 6, control="NONE(+3000)")
    report = {"mode": "full", "references": references,
              "rows": [row("none", 3), joint, row("NONE(+3000)", 0)]}  # fmt: skip
    checks.compare_rows(report)
    none_row, _, control = report["rows"]
    assert "versus_control" not in none_row and "versus_control" not in control
    versus = joint["versus_control"]
    assert versus["control"] == "NONE(+3000)"
    assert joint["versus_none"]["difference"] > 0 > versus["difference"]  # beats none, not its control
    assert not versus["within_budget"]  # a sixth of the sentences wrong: far over 5% of the control's BLEU
    lines = reporting.control_markdown(report["rows"])
    assert len(lines) == 2 and lines[1].startswith("BOTTLENECK(16,JOINT)+INT8 against NONE(+3000)")
    assert lines[1].endswith("**no**.")
    close = row("BOTTLENECK(16,JOINT)+INT8", 0, control="NONE(+3000)")  # as good as its control
    report["rows"][1] = close
    checks.compare_rows(report)
    assert close["versus_control"]["within_budget"] and close["versus_control"]["difference"] == 0


def test_a_distilled_or_warm_row_is_co_trained_after_its_control_and_from_it(
    prepared: tuple[train.Prepared, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    prep, cache = prepared
    warm = replace(ROW, label="BOTTLENECK(4,KD,WARM)+INT8", cut_teacher=50, cut_warm=True)
    distilled = replace(ROW, label="BOTTLENECK(4,KD)+INT8", cut_teacher=100)
    assert len({train.cut_key(row) for row in (ROW, warm, distilled)}) == 3  # cached apart
    assert train.cut_key(ROW) == "k4-r16-16-ae5-co6"  # the plan's keys (its cache files) unchanged
    with pytest.raises(ValueError, match=r"KD,WARM\)\+INT8: its control's halves are needed first"):
        cotrain.cotrain(prep, warm)
    with one_torch_thread():
        ready = cotrain.with_cut_states(prep, [warm, distilled], cache, "django", threads=1)
        monkeypatch.setattr(cotrain, "COTRAIN_LR", 0.0)  # nothing moves: each row keeps its start
        still = {row.label: cotrain.cotrain(prep, row, ready.cut_states[train.cut_key(CONTROL)])
                 for row in (warm, distilled)}  # fmt: skip
    assert list(ready.cut_states) == [train.cut_key(CONTROL), train.cut_key(warm), train.cut_key(distilled)]
    control = ready.cut_states[train.cut_key(CONTROL)]
    lm = "plm.blocks.0.ff.0.weight"
    assert torch.equal(still[warm.label]["encoder"][lm], control["encoder"][lm])  # the control's halves
    shared = train.Stages(prep, train.Row("none"), seed=0).encoder.state_dict()[lm]
    assert torch.equal(still[distilled.label]["encoder"][lm], shared)  # the shared ones
    assert not torch.equal(ready.cut_states[train.cut_key(distilled)]["encoder"][lm], shared)
    logits = torch.randn(2, 5, 11)
    target = torch.tensor([[4, 5, 6, 0, 0], [7, 8, 0, 0, 0]])
    assert float(cotrain.distillation(logits, logits, target)) == pytest.approx(0.0, abs=1e-6)
    assert float(cotrain.distillation(logits, torch.randn(2, 5, 11), target)) > 0
    padded = logits.clone()
    padded[0, 3:] = torch.randn(2, 11)  # padding positions never count
    assert float(cotrain.distillation(logits, padded, target)) == pytest.approx(0.0, abs=1e-6)


def test_probe_rows_names_a_distillation_flag_it_cannot_honour() -> None:
    import probe_rows

    row = probe_rows.parse_row("kd=int8,int8,16,d256u256p3000j3000t50w")
    assert (row.cut_teacher, row.cut_warm, row.cut_cotrain) == (50, True, 3000)
    with pytest.raises(SystemExit, match="t and w shape a co-training, so they need jN"):
        probe_rows.parse_row("kd=int8,int8,16,d256t50")
    with pytest.raises(SystemExit, match="distillation weight t is a percentage"):
        probe_rows.parse_row("kd=int8,int8,16,j3000t150")
