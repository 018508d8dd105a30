"""Table 5 step times through the product: each row's fine-tuning as a real job across two clusters.

``run.py`` times a row as one process's compute plus its frames through the WAN emulator (a
synchronous step, one micro-batch). This runs the same fine-tuning (the prepared halves, the
training split, 64 pairs a step, the row's codecs) as a Nebula job (``job/``) on ``nebula local up``'s
two clusters: real switches, mTLS, boxed stage processes, the emulated WAN at the same shape, and the
product's pipeline (micro-batches under 1F1B, sender and receive-ahead threads). A row's step time
here is what a user of the product gets; ``auto`` rows let the product's own advisor choose. The rows
run ``--rounds`` times in turn and each row's steps are pooled (``pool_rounds``), so a slow drift of the
shared host lands on every row alike.

Each cluster holds only its side: the benchmark writes S's encoder and Spanish token ids into
account a's directory, T's decoder and English ids into account b's (where an earlier job of that
account would have left them), and the calibrated bottleneck's halves into both.

    .venv/bin/python bench/table5/product.py --out bench-results/table5 [--doc docs/bench/table5.md]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import corpus
import cotrain
import job_files
import plan
import product_checks as checks
import train

from nebula_common.cli.job import follow, onboard
from nebula_common.jobspec import load_spec
from nebula_common.launcher import LocalDeployment
from nebula_common.sdk.client import ClusterSession
from nebula_common.sdk.jobs import ProgramJob
from nebula_common.sdk.links import LinkProfile

JOB = job_files.JOB
DEFAULT_ROWS = (
    "none,FP16+INT8,ZSTD(INT8) both,INT4 both,ZSTD(INT4) both,"
    "BOTTLENECK(16,AE)+INT8,BOTTLENECK(16,JOINT)+INT8,"
    "ZSTD(INT8(ERROR=0.04))+ZSTD(INT8(ERROR=0.2)),ZSTD(INT8(ERROR=0.08))+ZSTD(INT8(ERROR=0.2)),"
    "ZSTD(INT8(ERROR=0.08))+ZSTD(INT8(ERROR=0.25)),auto"
)
AUTO = train.Row("auto", "auto", "auto")
"""The product's own choice: ``codec: auto`` both ways, told the link (it probes, advises and trials)."""
SKIP = 5
"""Steps left out of a row's median: the first pay one-off allocations and the pipeline's first fill."""
ROUNDS = 2
"""Every row runs this many times, the rows in turn (none, A, B, ..., none, A, B, ...), and its steps are
pooled: two jobs of one pair, one after the other, measured 0.325 and 0.362 s a step at 1 Mbit/s on
2 cores, a drift the size of the 10% rule; taking turns spreads it over every row alike."""
MARK = ("<!-- table5:product -->", "<!-- /table5:product -->")
REFERENCE = Path(__file__).resolve().parents[2] / "bench" / "results" / "table5" / "table5.json"
"""run.py's committed merged report: the BLEU verdicts ``auto`` is judged by when ``--out`` has none."""


def _rows(text: str) -> list[train.Row]:
    labels = plan.row_labels(text)
    by_label = {row.label: row for row in (*plan.FULL_ROWS, *plan.EXTRA_ROWS, AUTO)}
    unknown = [label for label in labels if label not in by_label]
    if unknown or labels[0] != "none":
        sys.exit(f"table5 product: --rows takes labels of {list(by_label)}, 'none' first; got {labels}")
    return [by_label[label] for label in labels]


def bad_arguments(args: argparse.Namespace) -> str:
    """What is wrong with the command line, before any file is read or cluster started ('' if nothing)."""
    if args.rounds < 1:
        return f"--rounds must be at least 1, got {args.rounds}"
    if args.steps <= SKIP:
        return f"--steps must be more than {SKIP} (the first {SKIP} are left out of each row's median)"
    if not math.isfinite(args.bandwidth_mbit) or args.bandwidth_mbit <= 0:
        return f"--bandwidth-mbit must be a positive number, got {args.bandwidth_mbit:g}"
    if not math.isfinite(args.delay_ms) or args.delay_ms < 0:
        return f"--delay-ms must be a number >= 0, got {args.delay_ms:g}"
    batch = load_spec(JOB).spec.data.batch_size
    if args.micro_batches < 1 or batch % args.micro_batches:
        return f"--micro-batches must divide the batch of {batch} pairs, got {args.micro_batches}"
    return ""


def _account_dir(deployment: LocalDeployment, cluster: str, account: str) -> Path:
    """The account's directory of the cluster's trainer, owned as the trainer owns its data dir."""
    data_dir = deployment.run_dir / cluster / "trainer"
    folder = data_dir / "accounts" / account / "table5"
    owner = data_dir.stat()
    for path in (folder.parent, folder):
        path.mkdir(mode=0o700, exist_ok=True, parents=True)
        os.chown(path, owner.st_uid, owner.st_gid)
    return folder


def run_row(
    row: train.Row,
    sessions: dict[str, ClusterSession],
    placed: dict[str, dict[str, str]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    overrides = job_files.job_overrides(
        row, placed, steps=args.steps, micro_batches=args.micro_batches, examples=args.examples
    )
    job = ProgramJob(load_spec(JOB, overrides))
    link = LinkProfile(
        bandwidth_mbit=args.bandwidth_mbit, rtt_ms=2 * args.delay_ms, source="the emulator's settings"
    )
    started = time.perf_counter()
    summary = follow(job, sessions, quiet=True, link=link)
    seconds = time.perf_counter() - started
    steps = summary.step_seconds[SKIP:] or summary.step_seconds
    sent = sum(traffic[0] for traffic in summary.stage_traffic.values())  # both directions, whole job
    choice = json.loads(job.codec_choice) if job.codec_choice else {}
    result = {
        "label": row.label,
        "forward": job.codec_forward,
        "backward": job.codec_backward,
        "cut_k": row.cut_k,
        "cut_cotrain": row.cut_cotrain,
        "succeeded": summary.succeeded,
        "messages": summary.stage_messages,
        "step_seconds": statistics.median(steps) if steps else math.nan,
        "steps": summary.step_seconds,
        "losses": summary.losses,
        "wan_bytes_per_step": sent / max(summary.steps_done, 1),
        "submission_to_last_step_seconds": seconds,
        "advice": {
            **{
                k: choice.get(k)
                for k in ("source", "predicted_step_seconds", "baseline_step_seconds", "link")
            },
            "reasons": (choice.get("trial") or {}).get("reasons", []),
        },
    }
    print(
        json.dumps(
            {k: result[k] for k in ("label", "forward", "backward", "step_seconds", "wan_bytes_per_step")}
        ),
        flush=True,
    )
    return result


def pool_rounds(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One result per row from several rounds of ``run_row``: the steps after the first ``SKIP`` of every
    round pooled into one median, bytes and time to the last step averaged, failures kept. An ``auto``
    row that chose another pair in a later round is a row of its own ("auto (round 2)"): a median over
    two pairs' steps would be neither's."""
    pooled: dict[tuple[str, str, str, int], list[dict[str, Any]]] = {}
    for number, results in enumerate(rounds, start=1):
        for result in results:
            key = (result["label"], result["forward"], result["backward"], result["cut_k"])
            if key not in pooled and any(k[0] == result["label"] for k in pooled):
                result = {**result, "label": f"{result['label']} (round {number})"}
                key = (result["label"], *key[1:])
            pooled.setdefault(key, []).append(result)
    merged = []
    for runs in pooled.values():
        first = runs[0]
        steps = [s for run in runs for s in (run["steps"][SKIP:] or run["steps"])]
        merged.append(
            {
                **first,
                "succeeded": all(run["succeeded"] for run in runs),
                "messages": {k: v for run in runs for k, v in run["messages"].items()},
                "step_seconds": statistics.median(steps) if steps else math.nan,
                "round_step_seconds": [run["step_seconds"] for run in runs],
                "steps": [run["steps"] for run in runs],
                "wan_bytes_per_step": statistics.mean(run["wan_bytes_per_step"] for run in runs),
                "submission_to_last_step_seconds": statistics.mean(
                    run["submission_to_last_step_seconds"] for run in runs
                ),
            }
        )
    return merged


def advice_lines(results: list[dict[str, Any]]) -> list[str]:
    """What each ``auto`` row chose and predicted, against what its job and none's measured."""
    lines = []
    for result in results:
        advice = result["advice"]
        if not advice.get("predicted_step_seconds"):
            continue
        lines.append(
            f"`{result['label']}` ({advice['source']}) chose `{result['forward']}` / `{result['backward']}`: "
            f"predicted {advice['predicted_step_seconds']:.3f} s a step, measured "
            f"{result['step_seconds']:.3f}; none predicted {advice['baseline_step_seconds']:.3f}, measured "
            f"{results[0]['step_seconds']:.3f}"
            + (f"; its link: {link['source']}." if (link := advice.get("link") or {}).get("source") else ".")
        )
    return lines


def markdown(report: dict[str, Any]) -> str:
    modelled = report.get("modelled", {})
    lines = [
        "Two clusters of `nebula local up` (mTLS, boxed stages), WAN emulator "
        f"{report['bandwidth_mbit']:g} Mbit/s, {report['delay_ms']:g} ms one-way; {report['steps']} steps of "
        f"64 pairs in {report['micro_batches']} micro-batches (1F1B), "
        + (f"{report['rounds']} rounds of the rows in turn, " if report["rounds"] > 1 else "one round, ")
        + f"the median of every round's steps after the first {SKIP}; "
        f"{report['minutes']:.1f} min wall, load average {report['load'][0]:.1f} before / "
        f"{report['load'][1]:.1f} after on {os.cpu_count()} CPUs.",
        "",
        "| row | forward | backward | WAN bytes a step | s/step (product) | each round | speed-up "
        "| s/step (run.py model) | submission to last step |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        model = modelled.get(r["label"])
        each = " / ".join(f"{x:.3f}" for x in r.get("round_step_seconds", [r["step_seconds"]]))
        lines.append(
            f"| {r['label']} | `{r['forward']}` | `{r['backward']}` | {r['wan_bytes_per_step']:,.0f} | "
            f"{r['step_seconds']:.3f} | {each} | {r['speedup']:.1f}x | {f'{model:.3f}' if model else '-'} | "
            f"{r['submission_to_last_step_seconds']:.0f} s |"
        )
    lines += ["", *advice_lines(report["rows"]), *report.get("auto_rule", [])]
    lines += ["", "Checks: " + ("; ".join(report["failures"]) if report["failures"] else "all passed.")]
    return "\n".join(lines) + "\n"


def _modelled(path: Path, bandwidth_mbit: float, delay_ms: float) -> dict[str, float]:
    """run.py's modelled s/step per row, from its last merged report (if there is one) of the same link:
    a model of another link's step would sit beside this run's as if comparable."""
    try:
        report = json.loads(path.read_text())
        rows, link = report["rows"], (float(report["bandwidth_mbit"]), float(report["delay_ms"]))
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if link != (bandwidth_mbit, delay_ms):
        return {}
    return {row["label"]: row["step_seconds"] for row in rows if "step_seconds" in row}


def _shown(path: Path) -> str:
    """``path`` as the report names it: relative to the checkout when inside it."""
    try:
        return f"`{path.resolve().relative_to(REFERENCE.parents[3])}`"
    except ValueError:
        return f"`{path}`"


def write_doc(doc: Path, text: str) -> None:
    content = doc.read_text()
    begin, end = content.find(MARK[0]), content.find(MARK[1])
    if begin < 0 or end < begin:
        sys.exit(f"table5 product: {doc} has no {MARK[0]} ... {MARK[1]} section")
    doc.write_text(content[: begin + len(MARK[0])] + "\n" + text + content[end:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path(".cache/table5"))
    parser.add_argument(
        "--rows", default=DEFAULT_ROWS, help=f"Row labels, none first (default {DEFAULT_ROWS})."
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"Runs of every row, in turn ({ROUNDS}).")
    parser.add_argument("--bandwidth-mbit", type=float, default=1.0)
    parser.add_argument("--delay-ms", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=Path("bench-results/table5"))
    parser.add_argument("--doc", type=Path, help="Also rewrite this markdown file's product section.")
    args = parser.parse_args(argv)
    problem = bad_arguments(args)
    if problem:
        sys.exit(f"table5 product: {problem}")
    rows = _rows(args.rows)
    started, load_before = time.perf_counter(), os.getloadavg()
    try:
        manifest, train_pairs, evaluated = corpus.load(args.cache, "dev")
    except corpus.CorpusError as exc:
        sys.exit(f"table5 product: corpus: {exc}")
    config = plan.FULL_MODEL
    prep = train.prepare(
        train_pairs, evaluated, config, args.cache / "models", manifest["sha256"]["train.tsv"]
    )
    prep = cotrain.with_cut_states(prep, rows, args.cache / "models", manifest["sha256"]["train.tsv"])
    args.examples = len(prep.train_es)
    files = job_files.stage_files(prep, rows)
    run_dir = Path(tempfile.mkdtemp(prefix="table5-product-"))
    rounds: list[list[dict[str, Any]]] = []
    try:
        with LocalDeployment(
            run_dir=run_dir, bandwidth_mbit=args.bandwidth_mbit, delay_ms=args.delay_ms
        ) as deployment:
            sessions, placed = {}, {}
            for cluster, account in (("a", "table5-s"), ("b", "table5-t")):
                state = deployment.cluster_state[cluster]
                sessions[cluster] = onboard(deployment.endpoints(cluster), state.admin_password, account)
                folder = _account_dir(deployment, cluster, account)
                placed[cluster] = job_files.place(
                    folder, files[cluster], (deployment.run_dir / cluster / "trainer").stat()
                )
            rounds = [[run_row(row, sessions, placed, args) for row in rows] for _ in range(args.rounds)]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    results = pool_rounds(rounds)
    checks.speedups(results)
    raw = 2 * config.tune_batch * config.length * config.d_model * 4
    bleu = args.out / "table5.json" if (args.out / "table5.json").is_file() else REFERENCE
    rule_lines, rule_failures = checks.auto_rule(results, checks.judged_rows(bleu), _shown(bleu))
    report = {
        "bandwidth_mbit": args.bandwidth_mbit,
        "delay_ms": args.delay_ms,
        "steps": args.steps,
        "micro_batches": args.micro_batches,
        "rounds": args.rounds,
        "rows": results,
        "modelled": _modelled(bleu, args.bandwidth_mbit, args.delay_ms),
        "auto_rule": rule_lines,
        "failures": checks.failures(results, raw) + rule_failures,
        "minutes": (time.perf_counter() - started) / 60,
        "load": (load_before[0], os.getloadavg()[0]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table5-product.json").write_text(json.dumps(report, indent=2))
    text = markdown(report)
    (args.out / "table5-product.md").write_text(text)
    if args.doc:
        write_doc(args.doc, text)
    print(text)
    if report["failures"]:
        sys.exit("table5 product: " + "; ".join(report["failures"]))


if __name__ == "__main__":
    main()
