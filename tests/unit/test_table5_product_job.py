"""The Table 5 timing job (``bench/table5/job``): the benchmark's fine-tuning as a product job.

Run here unsplit (the reference runner, both stages in one process) on a tiny prepared model: the
frozen LMs stay bit-identical, the adapters and the decoder's output layer train, a calibrated
bottleneck loads from its halves file, and the benchmark's failure rules name what is wrong.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from nebula_common.jobspec import load_spec
from nebula_common.jobspec.reference import run_unsplit
from nebula_common.zoo.adapters import AdapterTransformerDecoder, AdapterTransformerEncoder, LanguageModel
from nebula_common.zoo.bottleneck import DownProjection, UpProjection, save_halves

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "bench" / "table5" / "job" / "job.yaml"
VOCAB, LENGTH, D, HEADS = 40, 8, 16, 2


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("table5-job")
    torch.manual_seed(0)
    encoder = AdapterTransformerEncoder(LanguageModel(VOCAB, LENGTH, D, HEADS, 1, causal=False), 8)
    decoder = AdapterTransformerDecoder(LanguageModel(VOCAB, LENGTH, D, HEADS, 1, causal=True), HEADS, 8)
    source = torch.randint(4, VOCAB, (64, LENGTH))
    source[:, 5:] = 0  # padding, as real batches have
    target = torch.randint(4, VOCAB, (64, LENGTH))
    paths = {
        "encoder": folder / "encoder.pt",
        "decoder": folder / "decoder.pt",
        "es": folder / "es.pt",
        "en": folder / "en.pt",
        "halves": folder / "cut.pt",
    }
    torch.save(encoder.state_dict(), paths["encoder"])
    torch.save(decoder.state_dict(), paths["decoder"])
    torch.save(source, paths["es"])
    torch.save(target, paths["en"])
    save_halves(str(paths["halves"]), DownProjection(D, 4, residual=32), UpProjection(D, 4, residual=32))
    return paths


def _options(prepared: dict[str, Path], **extra: Any) -> dict[str, Any]:
    options = {
        "steps": 4,
        "data.batch_size": 16,
        "data.examples": 64,
        "stages.0.options.weights": str(prepared["encoder"]),
        "stages.0.options.examples": str(prepared["es"]),
        "stages.1.options.weights": str(prepared["decoder"]),
        "stages.1.options.examples": str(prepared["en"]),
    }
    for index in (0, 1):
        options |= {f"stages.{index}.options.d_model": D, f"stages.{index}.options.n_heads": HEADS}
        options |= {f"stages.{index}.options.adapter": 8}
        options |= {f"stages.{index}.options.{key}": value for key, value in extra.items()}
    return options


def test_the_lms_stay_frozen_while_adapters_and_the_output_layer_train(prepared: dict[str, Path]) -> None:
    result = run_unsplit(load_spec(JOB, _options(prepared)))
    assert len(result.losses) == 4 and all(math.isfinite(x) for x in result.losses)
    encoder, decoder = result.state_dicts["encoder"], result.state_dicts["decoder"]
    for name, value in torch.load(prepared["encoder"], weights_only=True).items():
        if name.startswith("plm."):
            assert torch.equal(encoder[name], value), f"{name}: a frozen encoder weight changed"
    start = torch.load(prepared["decoder"], weights_only=True)
    for name, value in start.items():
        changed = not torch.equal(decoder[name], value)
        output_layer = name.startswith(("plm.head.", "plm.norm."))
        if name.startswith("plm.") and not output_layer:
            assert not changed, f"{name}: a frozen decoder weight changed"
    assert not torch.equal(decoder["plm.head.weight"], start["plm.head.weight"])  # the output layer trains
    assert any(
        not torch.equal(encoder[k], v)
        for k, v in torch.load(prepared["encoder"], weights_only=True).items()
        if "adapters" in k
    )


def test_a_calibrated_bottleneck_loads_its_halves_and_trains_at_its_own_rate(
    prepared: dict[str, Path],
) -> None:
    job = load_spec(JOB, _options(prepared, cut_k=4, cut_residual=32, cut_init=str(prepared["halves"])))
    result = run_unsplit(job)
    assert all(math.isfinite(x) for x in result.losses)
    halves = torch.load(prepared["halves"], weights_only=True)
    encoder = result.state_dicts["encoder"]
    assert encoder["down.proj.weight"].shape == halves["down"]["proj.weight"].shape == (4, D)
    assert not torch.equal(encoder["down.proj.weight"], halves["down"]["proj.weight"])  # loaded, then trained
    fresh = run_unsplit(load_spec(JOB, _options(prepared, cut_k=4, cut_residual=32)))
    assert not torch.equal(fresh.state_dicts["encoder"]["down.proj.weight"], encoder["down.proj.weight"])


def test_a_halves_file_of_another_width_is_refused_by_name(prepared: dict[str, Path]) -> None:
    job = load_spec(JOB, _options(prepared, cut_k=4, cut_residual=64, cut_init=str(prepared["halves"])))
    with pytest.raises(Exception, match="does not fit this stage"):
        run_unsplit(job)


def _row(
    label: str,
    seconds: float,
    sent: float,
    ok: bool = True,
    predicted: float = 0.0,
    codecs: tuple[str, str] = ("none", "none"),
) -> dict[str, Any]:
    """A product run's row as ``product.run_row`` records it."""
    return {
        "advice": {"predicted_step_seconds": predicted} if predicted else {},
        "label": label,
        "forward": codecs[0],
        "backward": codecs[1],
        "cut_k": 0,
        "succeeded": ok,
        "messages": {} if ok else {"decoder": "FAILED: out of memory"},
        "losses": [2.0, 1.9],
        "step_seconds": seconds,
        "wan_bytes_per_step": sent,
    }


def test_the_benchmark_fails_a_padded_none_a_failed_job_and_a_slower_row() -> None:
    sys.path.insert(0, str(ROOT / "bench" / "table5"))
    import product_checks as product

    row = _row

    good = [row("none", 2.0, 200_000), row("FP16+INT8", 0.8, 80_000), row("auto", 0.5, 5e4, predicted=0.45)]
    product.speedups(good)
    assert product.failures(good, raw_step_bytes=800_000) == []
    padded = [
        row("none", 2.0, 700_000),
        row("ZSTD(INT8) both", 2.1, 90_000),
        row("auto", 1.0, 1, ok=False),
        row("auto ", 0.5, 5e4, predicted=0.3),
    ]
    product.speedups(padded)
    found = product.failures(padded, raw_step_bytes=800_000)
    assert any("auto: the job did not succeed" in f and "out of memory" in f for f in found)
    assert any("padding crosses the link" in f for f in found)
    assert any(f.startswith("ZSTD(INT8) both: 0.95x") for f in found)
    assert any("auto predicted 0.300 s a step, measured 0.500 (more than 25% off)" in f for f in found)
    assert len(found) == 4


def test_auto_is_judged_against_the_fastest_row_within_the_bleu_budget(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "bench" / "table5"))
    import product_checks as checks

    def verdict(label: str, forward: str, backward: str, within: bool, k: int = 0, co: int = 0) -> dict:
        return {"label": label, "forward": forward, "backward": backward, "cut_k": k, "cut_cotrain": co,
                "versus_none": {"within_budget": within}}  # fmt: skip

    report = tmp_path / "table5.json"
    report.write_text(json.dumps({"rows": [
        verdict("none", "none", "none", True),
        verdict("INT4 both", "int4", "int4", True),
        verdict("BOTTLENECK(16,AE)+INT8", "int8", "int8", False, k=16),
        verdict("BOTTLENECK(16,JOINT)+INT8", "int8", "int8", True, k=16, co=1500),
        verdict("ZSTD(INT8) both", "zstd(int8)", "zstd(int8)", True),
    ]}))  # fmt: skip
    judged = checks.judged_rows(report)
    bottleneck = {**_row("BOTTLENECK(16,AE)+INT8", 0.25, 1.4e4, codecs=("int8", "int8")), "cut_k": 16}
    joint = {**bottleneck, "label": "BOTTLENECK(16,JOINT)+INT8", "step_seconds": 0.24, "cut_cotrain": 1500}
    base = [
        _row("none", 1.6, 2.2e5),
        _row("INT4 both", 0.35, 3.1e4, codecs=("int4", "int4")),
        bottleneck,
        joint,
    ]
    # two k = 16 rows with the same codecs are told apart by how their halves were trained
    assert judged[("int8", "int8", 16, 0)] == ("BOTTLENECK(16,AE)+INT8", False)
    assert judged[("int8", "int8", 16, 1500)] == ("BOTTLENECK(16,JOINT)+INT8", True)

    def judge(seconds: float, codecs: tuple[str, str]) -> tuple[list[str], list[str]]:
        return checks.auto_rule(
            [*base, _row("auto", seconds, 3e4, predicted=0.4, codecs=codecs)], judged, "t"
        )

    # the bottlenecks are faster, one of them within the budget: a model change auto does not choose
    lines, found = judge(0.37, ("int4", "int4"))
    assert found == [] and "ratio **1.057** against INT4 both" in lines[0] and lines[0].endswith("met.")
    _, found = judge(0.42, ("zstd(int8)", "zstd(int8)"))
    assert found == ["auto: 1.200x the fastest row's step within the BLEU budget (rule: <= 1.10)"]
    _, found = judge(0.36, ("zstd(int8)", "int4"))
    assert found == ["auto: its pair `zstd(int8)` / `int4` has no row in t: not judged"]
    lines, found = judge(0.36, ("zstd(int4)", "int4"))  # lossless zstd: int4's quality, its row
    assert found == [] and "BLEU row: INT4 both" in lines[0]
    lines, found = judge(0.26, ("int8", "int8"))  # the bottleneck's codecs, without its bottleneck
    assert found == [] and "BLEU row: ZSTD(INT8) both" in lines[0]
    assert checks.auto_rule(base, judged, "t") == ([], [])  # no auto row: nothing to judge
    lines, found = checks.auto_rule([*base, _row("auto", 0.5, 3e4, predicted=0.4)], {}, "t")
    assert found == [] and "not judged" in lines[0]
    assert checks.judged_rows(tmp_path / "missing.json") == {}


def test_rounds_pool_a_rows_steps_and_keep_an_auto_that_changed_its_mind_apart() -> None:
    sys.path.insert(0, str(ROOT / "bench" / "table5"))
    import product

    def run(
        label: str, steps: list[float], codecs: tuple[str, str] = ("int4", "int4"), ok: bool = True
    ) -> dict[str, Any]:
        return {**_row(label, 0.0, 100.0, ok=ok, codecs=codecs), "steps": steps,
                "submission_to_last_step_seconds": 10.0}  # fmt: skip

    skip = [9.0] * product.SKIP  # the first steps of every round are left out
    first = [run("none", [*skip, 1.0, 1.2]), run("INT4 both", [*skip, 0.3, 0.4]), run("auto", [*skip, 0.5])]
    second = [
        run("none", [*skip, 1.4]),
        run("INT4 both", [*skip, 0.36], ok=False),
        run("auto", [*skip, 0.6], codecs=("zstd(int8)", "int4")),
    ]
    pooled = {r["label"]: r for r in product.pool_rounds([first, second])}
    assert list(pooled) == ["none", "INT4 both", "auto", "auto (round 2)"]
    assert pooled["none"]["step_seconds"] == pytest.approx(1.2)  # median of 1.0, 1.2, 1.4: skips left out
    assert pooled["none"]["round_step_seconds"] == [0.0, 0.0] and len(pooled["none"]["steps"]) == 2
    assert pooled["INT4 both"]["step_seconds"] == pytest.approx(0.36)
    assert not pooled["INT4 both"]["succeeded"] and "out of memory" in str(pooled["INT4 both"]["messages"])
    assert (pooled["auto"]["step_seconds"], pooled["auto (round 2)"]["step_seconds"]) == (0.5, 0.6)
    assert pooled["auto (round 2)"]["forward"] == "zstd(int8)"


def test_the_modelled_column_comes_only_from_a_run_py_report_of_the_same_link(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "bench" / "table5"))
    import product

    report = tmp_path / "table5.json"
    rows = [{"label": "none", "step_seconds": 2.2}, {"label": "INT4 both", "step_seconds": 0.57}]
    report.write_text(json.dumps({"bandwidth_mbit": 1.0, "delay_ms": 10.0, "rows": rows}))
    assert product._modelled(report, 1.0, 10.0) == {"none": 2.2, "INT4 both": 0.57}
    assert product._modelled(report, 0.15, 10.0) == {}  # run.py modelled 1 Mbit/s, not this link
    assert product._modelled(report, 1.0, 40.0) == {}
    report.write_text(json.dumps({"rows": rows}))  # a report that does not say its link
    assert product._modelled(report, 1.0, 10.0) == {}
    assert product._modelled(tmp_path / "missing.json", 1.0, 10.0) == {}


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--steps", "5"], "--steps must be more than 5"),
        (["--rounds", "0"], "--rounds must be at least 1, got 0"),
        (["--bandwidth-mbit", "0"], "--bandwidth-mbit must be a positive number, got 0"),
        (["--bandwidth-mbit", "nan"], "--bandwidth-mbit must be a positive number"),
        (["--delay-ms", "-1"], "--delay-ms must be a number >= 0, got -1"),
        (["--micro-batches", "3"], "--micro-batches must divide the batch of 64 pairs, got 3"),
        (["--micro-batches", "0"], "--micro-batches must divide the batch of 64 pairs, got 0"),
    ],
)
def test_the_benchmark_names_a_bad_argument_before_reading_anything(
    argv: list[str], named: str, tmp_path: Path
) -> None:
    sys.path.insert(0, str(ROOT / "bench" / "table5"))
    import product

    missing = tmp_path / "no-cache"
    with pytest.raises(SystemExit) as stopped:
        product.main(["--cache", str(missing), "--out", str(tmp_path / "out"), *argv])
    assert str(stopped.value).startswith("table5 product: ") and named in str(stopped.value)
    assert not missing.exists() and not (tmp_path / "out").exists()
