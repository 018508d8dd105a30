"""The Table 5 benchmark's parts on real pieces: codec-in-the-loop fine-tuning and the emulated-link clock.

Small and offline (Django's installed catalogues stand in for the fetched corpus); the benchmark's
numbers themselves live in docs/bench/table5.md. Timing checks are one-sided: load can only slow a
transfer down, never make it beat the link's cap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from nebula_common.codec.trial import (
    Candidate,
    Link,
    TrialRun,
    choose_by_trial,
    trial_loss,
    trial_progress,
    within_budget,
)
from nebula_common.wan import LinkShape
from nebula_common.zoo.catalogues import clean_pairs, parse_mo
from nebula_common.zoo.splits import Split, split
from nebula_common.zoo.text_data import PAD, catalogue_paths

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "table5"))
import advisor
import checks
import link_clock
import merge
import plan
import run
import train

from tests.support.torch_threads import one_torch_thread

pytestmark = pytest.mark.timeout(120)
TRIAL_LOSS_TOLERANCE, TRIAL_PROGRESS_TOLERANCE, TRIAL_MAX_TRIALS, TRIAL_STEPS = 0.02, 0.10, 6, 90
"""The trial rules the recorded Table 5 trials were taken under (90 steps per candidate, six at most)."""
TINY = train.ModelConfig(d_model=32, n_layers=1, vocab=600, batch=8, pretrain_steps=3)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """As the benchmark runs: one torch thread (tiny tensors; more threads only contend on a busy host)."""
    with one_torch_thread():
        yield


def _parts() -> Split:
    """Django's installed catalogues, split as the corpus is (train / dev / test)."""
    entries = [e for p in catalogue_paths() for e in parse_mo(p.with_suffix(".mo").read_bytes(), str(p))]
    return split(clean_pairs(entries, 16), 0.05, 0.1, seed=13)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> train.Prepared:
    parts = _parts()
    return train.prepare(
        parts.train, parts.test, TINY, tmp_path_factory.mktemp("models"), "django", threads=1
    )


def _real_positions(prepared: train.Prepared, batch: int, steps: int) -> int:
    """Source positions that are not padding in the last step's batch, drawn as ``train_steps`` draws it
    (seed 0): only they cross the cut, the padding's rows are left out of the frames."""
    generator = torch.Generator().manual_seed(1000)
    for _ in range(steps):
        index = torch.randint(len(prepared.train_es), (batch,), generator=generator)
    return int((prepared.train_es[index] != PAD).sum())


def test_codecs_and_bottleneck_shrink_the_frames_by_their_ratios(prepared: train.Prepared) -> None:
    raw = TINY.batch * TINY.length * TINY.d_model * 4
    none = train.fine_tune(prepared, train.Row("none"), 0, steps=2, eval_pairs=16)
    cut = train.fine_tune(prepared, train.Row("cut", "int8", "int8", cut_k=4), 0, steps=2, eval_pairs=16)
    real = _real_positions(prepared, TINY.batch, steps=2)
    assert real < TINY.batch * TINY.length  # the batch is padded, or this test shows nothing
    for frames in (none.forward_bytes, none.backward_bytes):
        # A frame is the serialized header (with its one-bit-a-position map) plus the real positions.
        header = frames[-1] - real * TINY.d_model * 4
        assert 0 < header < 200, (frames[-1], raw, real)
    elements = real * 4  # k = 4 of d = 32 at each real position: what crosses, each way
    for frames in (cut.forward_bytes, cut.backward_bytes):  # one byte each + int8's 4-byte scale + header
        assert elements + 4 < frames[-1] <= elements + 4 + 200
    assert 0 < cut.energy < 1  # the bottleneck started from a real calibration subspace
    assert len(none.losses) == 2 and 0 <= none.bleu <= 100 and 0 <= cut.chrf <= 100


def test_the_link_clock_never_beats_the_emulated_cap() -> None:
    shape = LinkShape(bandwidth_mbit=8.0, delay_ms=5.0)
    forward, backward = os.urandom(60_000), os.urandom(20_000)
    seconds = link_clock.link_seconds(shape, forward, backward, repeats=2)
    floor = (
        2 * shape.delay_ms / 1000
        + (shape.wire_bytes(80_008) - 2 * shape.burst_bytes) * 8 / shape.bits_per_second
    )
    assert seconds >= floor, f"{seconds:.3f} s for 80 kB at 8 Mbit/s beats the cap (floor {floor:.3f} s)"
    assert seconds < 30


def test_the_auto_row_is_the_products_pick_for_the_job_and_is_judged_against_the_codec_rows(
    prepared: train.Prepared, tmp_path: Path
) -> None:
    # The product's own decision (probe, the codec service's ranking in-process, trial sizing), on the
    # job product.py submits, built from these prepared halves; a slow link, so the link decides.
    choice = advisor.auto_pair(prepared, LinkShape(bandwidth_mbit=0.2, delay_ms=10.0), 40, tmp_path)
    record = choice["choice"]
    assert record["source"] == "codec-service advice"
    assert record["link"] == {"bandwidth_mbit": 0.2, "rtt_ms": 20.0, "source": "the benchmark's link"}
    ranked = {d: [o["spec"] for o in options] for d, options in record["alternatives"].items()}
    assert choice["forward"] in ranked["forward"] and choice["backward"] in ranked["backward"]
    assert (choice["forward"], choice["backward"]) != ("none", "none")  # 0.2 Mbit/s: compression pays
    assert record["predicted_step_seconds"] < record["baseline_step_seconds"]
    assert (tmp_path / advisor.CALIBRATION).is_file()  # this host's calibration, cached for the next run

    def report(auto_step: float, bleu: dict[str, float]) -> dict:
        steps = {"none": 1.5, "FP16+INT8": 0.5, "cut4": 0.2, "auto": auto_step}
        table = [
            {
                "label": k,
                "forward": "zstd(int8(error=0.04))" if k == "auto" else "int8",
                "backward": "zstd(int8(error=0.2))" if k == "auto" else "int8",
                "cut_k": 4 if k == "cut4" else 0,
                "step_seconds": v,
                # what stats.compare decides from the sentences; here: within 5% of none's BLEU
                "versus_none": {"within_budget": bleu[k] >= 0.95 * bleu["none"], "budget": 1.0},
            }
            for k, v in steps.items()
        ]
        return {"rows": table}

    fair = {"none": 20.0, "FP16+INT8": 19.5, "cut4": 19.8, "auto": 19.6}
    # auto at 1.08x FP16+INT8's step meets the rule; the faster bottleneck (a model change, not a codec
    # auto could pick) is not what it is judged against.
    check = checks.advisor_check(report(0.54, fair))
    assert check["fastest_within_budget"] == "FP16+INT8" and check["ok"], check
    assert check["advisor_pick"] == "zstd(int8(error=0.04)) / zstd(int8(error=0.2))"
    slow = checks.advisor_check(report(0.6, fair))  # 1.2x: a miss
    assert slow["ratio"] == pytest.approx(1.2) and not slow["ok"]
    assert checks.failures({"rows": [], "advisor_check": slow}) == [f"auto missed the 10% rule: {slow}"]
    outside = checks.advisor_check(report(0.3, {**fair, "auto": 18.0}))  # fast, but loses 2 BLEU
    assert not outside["advisor_pick_within_budget"] and not outside["ok"]
    assert checks.advisor_check({"rows": report(0.5, fair)["rows"][:3]}) is None  # no auto row: not judged


def test_a_reduced_run_of_a_few_rows_refuses_an_unknown_row_or_none_not_first(tmp_path: Path) -> None:
    script = Path(run.__file__)
    for rows in ("none,FP16+INT8,BOTTLENECK(5)", "FP16+INT8,none"):
        done = subprocess.run(
            [sys.executable, str(script), "--rows", rows, "--cache", str(tmp_path), "--out", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=100,
        )
        assert done.returncode == 1, done
        assert "table5: --rows takes labels of" in done.stderr and "'none' first" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr and not list(tmp_path.iterdir())


def test_merging_summaries_whose_rows_carry_no_paired_statistics_is_refused(tmp_path: Path) -> None:
    rows = [{"label": label, "bleu": [22.0], "step_seconds": 1.0} for label in ("none", "A")]
    summary = {"mode": "reduced", "seeds": 1, "steps": 300, "split": "test", "row_labels": ["none", "A"],
               "figure10_runs": [], "wall_seconds": 1.0, "load_after": [0.1, 0.1, 0.1], "lookup": None,
               "rows": rows}  # fmt: skip
    (tmp_path / "a.json").write_text(json.dumps(summary))
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(Path(run.__file__)), "--merge", str(tmp_path / "a.json"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 1, done
    assert "rows must carry their paired statistics (versus_none)" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not out.exists()


def test_the_fine_tuning_batch_is_apart_from_pre_training_and_a_bad_value_is_refused(
    prepared: train.Prepared, tmp_path: Path
) -> None:
    # Apart from pre-training: the cached LMs' key ignores it; the full plan keeps the batch-32 LMs.
    assert TINY.digest("c") == train.ModelConfig(**{**TINY.__dict__, "finetune_batch": 24}).digest("c")
    assert plan.FULL_MODEL.batch == 32 and plan.FULL_MODEL.tune_batch == 64 and plan.FULL["steps"] == 300
    assert plan.QUICK["model"].tune_batch == plan.QUICK["model"].batch  # quick mode as before
    # Used: the steps' cut tensors (forward and gradient) carry finetune_batch sentences, not batch.
    wide = train.Prepared(
        **{**prepared.__dict__, "config": train.ModelConfig(**{**TINY.__dict__, "finetune_batch": 24})}
    )
    done = train.train_steps(wide, train.Row("none"), 0, steps=2)
    sent = _real_positions(prepared, 24, steps=2) * TINY.d_model * 4
    assert all(sent < size < sent + 200 for size in (done.forward_bytes[-1], done.backward_bytes[-1])), (
        done.forward_bytes
    )
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match=r"ModelConfig\.finetune_batch must be an integer >= 0"):
            train.ModelConfig(finetune_batch=bad)
    done = subprocess.run(
        [
            sys.executable,
            str(Path(run.__file__)),
            "--finetune-batch",
            "0",
            "--cache",
            str(tmp_path),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 1, done
    assert "table5: --finetune-batch must be >= 1, got 0" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not list(tmp_path.iterdir())


def test_the_wide_bottleneck_rows_compress_both_directions_by_d_over_k_times_their_codec(
    prepared: train.Prepared,
) -> None:
    # The table's bottleneck rows at d = 64 (the full plan's width): k = 16 with int8 both ways is 16x
    # fewer bytes each way than float32 (4x fewer elements, 1 byte each instead of 4), k = 32 + int8 and
    # k = 16 + fp16 are 8x. Real frames of a real step (on a 1-layer d = 64 model).
    rows = {row.label: row for row in (*plan.FULL_ROWS, *plan.EXTRA_ROWS)}
    wide = replace(TINY, d_model=64, n_heads=4)
    prep = train.Prepared(**{**prepared.__dict__, "config": wide})
    prep.encoder_state = train._language_model(wide, prep.es.get_vocab_size(), causal=False).state_dict()
    prep.decoder_state = train._language_model(wide, prep.en.get_vocab_size(), causal=True).state_dict()
    positions = _real_positions(prep, wide.batch, steps=2)  # the padding's rows stay home
    raw = positions * 64 * 4
    for label, payload in (
        ("BOTTLENECK(16)+INT8", positions * 16 + 4),
        ("BOTTLENECK(16,residual)+INT8", positions * 16 + 4),
        ("BOTTLENECK(32)+INT8", positions * 32 + 4),
        ("BOTTLENECK(16)+FP16", positions * 16 * 2),
    ):
        done = train.train_steps(prep, rows[label], 0, steps=2)
        for frames in (done.forward_bytes, done.backward_bytes):
            assert payload < frames[-1] < payload + 200, (label, frames, payload)
        assert round(raw / payload) in (16, 8)
    assert raw // (positions * 16 + 4) == 15  # 16x the elements; the 4-byte scale and header take a hair
    assert {r.label for r in plan.QUICK_ROWS} <= set(rows) and plan.QUICK_ROWS[0].label == "none"
    # Two shards take the rows alternately: the Figure 10 row (its later starts are more runs) on shard 1,
    # the product's auto row last.
    assert plan.FULL_ROWS.index(plan.FIGURE10_ROW) % 2 == 1 and plan.FULL_ROWS[-1].label == advisor.LABEL


def test_the_bottleneck_has_its_own_learning_rate_under_the_same_warm_up(prepared: train.Prepared) -> None:
    config = replace(TINY, lr=1e-2, cut_lr=1e-3, warmup=4)
    assert config.digest("c") == TINY.digest("c")  # a fine-tuning field: the cached LMs stay valid
    stages = train.Stages(replace(prepared, config=config), train.Row("cut", cut_k=4), seed=0)
    for step, scale in ((0, 0.25), (3, 1.0), (10, 1.0)):
        stages.set_step(step)
        for optimizer, cut in ((stages.upstream_opt, stages.down), (stages.downstream_opt, stages.up)):
            lrs = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
            assert all(lrs[id(p)] == pytest.approx(1e-3 * scale) for p in cut.parameters())
            others = [lr for key, lr in lrs.items() if key not in {id(p) for p in cut.parameters()}]
            assert others and all(lr == pytest.approx(1e-2 * scale) for lr in others)
    plain = train.Stages(replace(prepared, config=replace(TINY, lr=1e-2)), train.Row("cut", cut_k=4), seed=0)
    plain.set_step(0)
    assert {g["lr"] for o in (plain.upstream_opt, plain.downstream_opt) for g in o.param_groups} == {1e-2}


def test_row_labels_keep_a_comma_inside_parentheses() -> None:
    assert plan.row_labels("none, BOTTLENECK(16,residual)+INT8,FP16(SVD(0.2))+INT8") == [
        "none",
        "BOTTLENECK(16,residual)+INT8",
        "FP16(SVD(0.2))+INT8",
    ]


def test_the_advisor_rule_on_recorded_table5_trials_rejects_the_bottleneck_and_keeps_int8() -> None:
    # Recorded trial numbers of the full plan (seed 0; no timing here): the first 90 losses,
    # compute and frame bytes of none, int8 both ways (what zstd(int8) computes: zstd is lossless) and
    # three bottlenecks that all ended >= 1.4 BLEU below none after 300 steps (or are not run to 300).
    recorded = json.loads((Path(__file__).parent / "data" / "table5_trials.json").read_text())
    rows = {row["label"]: row for row in recorded["rows"]}
    link = Link(**recorded["link"])

    def replay(candidate: Candidate, steps: int) -> TrialRun:
        row = rows[candidate.label]
        assert steps <= len(row["losses"]), "the recording holds 90 steps"
        return TrialRun(
            row["losses"][:steps],
            [row["compute_ms"] / 1000] * steps,
            row["forward_bytes"],
            row["backward_bytes"],
        )

    candidates = [Candidate(r["forward"], r["backward"], r["label"]) for r in recorded["rows"][1:]]
    baseline = Candidate("none", "none", "none")
    kwargs = dict(trial_steps=TRIAL_STEPS, tolerance=TRIAL_LOSS_TOLERANCE, baseline=baseline)
    # The old rule (relative trial loss only): BOTTLENECK(32)+INT8 is 1.1% over none at 90 steps: chosen.
    old = choose_by_trial(candidates, replay, link, max_trials=TRIAL_MAX_TRIALS, **kwargs)
    assert old.chosen.label == "BOTTLENECK(32)+INT8"
    # The benchmark's rule: that gap is 14% of what none learned in the trial: rejected; int8 is 0.02%.
    new = choose_by_trial(
        candidates,
        replay,
        link,
        max_trials=TRIAL_MAX_TRIALS,
        progress_tolerance=TRIAL_PROGRESS_TOLERANCE,
        **kwargs,
    )
    assert new.chosen.label == "int8 both", new.reasons
    by_label = {a.candidate.label: a for a in new.assessments}
    assert (
        by_label["BOTTLENECK(32)+INT8"].predicted_step_seconds < by_label["int8 both"].predicted_step_seconds
    )
    assert 0.10 < by_label["BOTTLENECK(32)+INT8"].progress_share < 0.2
    assert by_label["int8 both"].progress_share < 0.01
    # The slower bottlenecks are never tried (int8 both wins first); on their own the rule rejects them too.
    base_loss, progress = trial_loss(rows["none"]["losses"]), trial_progress(rows["none"]["losses"])
    for label in ("k63", "k32 frozen"):
        within, excess, share = within_budget(
            trial_loss(rows[label]["losses"]),
            base_loss,
            tolerance=TRIAL_LOSS_TOLERANCE,
            progress=progress,
            progress_tolerance=TRIAL_PROGRESS_TOLERANCE,
        )
        assert excess < TRIAL_LOSS_TOLERANCE and not within
        assert share > TRIAL_PROGRESS_TOLERANCE


def test_preparation_trains_halves_that_translate_and_each_row_starts_from_them_with_the_lms_frozen(
    prepared: train.Prepared, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = replace(TINY, translation_steps=6, translation_batch=8)
    cache = tmp_path / "models"
    trained_on: list[int] = []
    pretrain_all = train._pretrain_all

    def recorded(*args: Any) -> dict[str, Any]:
        trained_on.append(torch.get_num_threads())
        return pretrain_all(*args)

    monkeypatch.setattr(train, "_pretrain_all", recorded)
    prep = train.prepare(_parts().train, [], config, cache, "django", threads=1)
    losses = prep.pretrain_losses["translation"]
    assert len(losses) == 6 and all(loss == loss for loss in losses)  # every step trained, no NaN
    assert [p.name for p in cache.iterdir()] == [f"pretrained-{config.digest('django')}.pt"]  # no .partial
    stages = train.Stages(prep, train.Row("none"), seed=0)
    for half, module in (("encoder", stages.encoder), ("decoder", stages.decoder)):
        for name, value in module.state_dict().items():  # adapters and LMs: the translation-trained weights
            assert torch.equal(value, prep.translation_state[half][name]), (half, name)
    frozen = [name for name, p in stages.encoder.named_parameters() if not p.requires_grad]
    assert frozen and all(name.startswith("plm.") for name in frozen), frozen  # the LM frozen, adapters train
    again = train.prepare(_parts().train, [], config, cache, "django", threads=1)  # the cache, not a re-run
    assert again.pretrain_losses["translation"] == losses and trained_on == [1]
    with train.torch_threads(3):  # the rows' --threads: not the preparation's, which is made again
        train.prepare(_parts().train, [], config, cache, "django", threads=2)
        assert torch.get_num_threads() == 3
    assert trained_on == [1, 2]
    assert int(torch.load(cache / f"pretrained-{config.digest('django')}.pt")["threads"]) == 2
    untrained = train.Stages(prepared, train.Row("none"), seed=0)  # translation_steps 0: nothing loaded
    assert not prepared.translation_state and untrained.encoder is not None


def test_merge_joins_a_later_runs_rows_and_refuses_shards_of_another_plan(tmp_path: Path) -> None:
    def shard(labels: list[str], rows: list[str], seeds: int = 5) -> dict:
        return {"mode": "reduced", "seeds": seeds, "steps": 300, "split": "test", "row_labels": labels,
                "rows": [{"label": label} for label in rows], "figure10_runs": [], "wall_seconds": 1.0,
                "load_after": [0.1, 0.1, 0.1], "lookup": None, "advisor": None}  # fmt: skip

    first = shard(["none", "A", "B"], ["none", "B"])
    second = shard(["none", "A", "B"], ["A"])
    later = shard(["none", "C"], ["C"])  # a later run of one more row on the same plan
    report = merge.merge([first, second, later], [])
    assert [row["label"] for row in report["rows"]] == ["none", "A", "B", "C"] == report["row_labels"]
    with pytest.raises(merge.MergeError, match=r"differ in \['seeds'\]"):
        merge.merge([first, second, shard(["none", "C"], ["C"], seeds=2)], [])
    with pytest.raises(merge.MergeError, match="expected each of"):
        merge.merge([first, second, second], [])
    first["rows"][0]["bleu"] = [22.1, 21.9]
    rerun = shard(["none", "C"], ["none", "C"])  # a later run with its own none: the same halves
    rerun["rows"][0]["bleu"] = [22.1, 21.9]
    grown = merge.merge([first, second, rerun], [])
    assert [row["label"] for row in grown["rows"]] == ["none", "A", "B", "C"]
    assert grown["rows"][0] is first["rows"][0]
    full = shard(["none", "D"], ["none", "D"])  # a run with its outputs, merged into a committed summary
    full["references"] = ["a cat"]
    full["rows"] = [{**row, "bleu": [22.1, 21.9], "hypotheses": [["a cat"]]} for row in full["rows"]]
    onto_summary = merge.merge([first, second, full], [])
    assert "references" not in onto_summary  # nothing to pair a summary's rows with: each keeps its own
    assert all("hypotheses" not in row for row in onto_summary["rows"])
    rerun["rows"][0]["bleu"] = [22.1, 21.8]  # other halves (e.g. prepared on another thread count)
    with pytest.raises(
        merge.MergeError, match=r"later run's none scored \[22.1, 21.8\], the report's \[22.1, 21.9\]"
    ):
        merge.merge([first, second, rerun], [])
    bad = tmp_path / "shard.json"
    bad.write_text("{not json")
    with pytest.raises(merge.MergeError, match=r"shard\.json: not a shard report"):
        merge.read_shards([bad])
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps(first))
    assert merge.read_shards([ok]) == [first]
