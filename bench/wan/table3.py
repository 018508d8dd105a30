"""Benchmark: a job's throughput across the WAN vs inside one cluster (the paper's Table 3 analogue).

Why: Nebula-I's Table 3 reports inter-cluster training throughput at 0.85 of intra-cluster; the point
of the overlapped step pipeline is that the WAN, not the software, sets the pace, so the same job
across our emulated WAN should lose little against the same job on a local network. Each job runs
on two real local deployments, one after the other, identical except for the link between the
switches (the WAN emulator's shape), both up at once, the runs interleaved (intra, inter, inter,
intra, ...) so that the shared machine's drifting load falls on both alike:

* inter-cluster: ``--bandwidth-mbit`` (60) / ``--delay-ms`` (20 one-way), the demo's WAN;
* intra-cluster: 10,000 Mbit/s, 0 ms: the same processes, hops and TLS, with the link not limiting.

Each cluster's processes are pinned to a core of their own (a: CPU 0, b: CPU 1), one torch thread
per trainer, as in ``roofline.py``. Throughput is **training samples per second** of the loss-owning
stage: batch size / mean steady step seconds (first ``--warmup`` steps excluded); the ratio is
inter / intra. Jobs: ``numbers`` (backprop across the cut, activations forward and gradients back;
GPipe, 8 micro-batches; by default at the regime of ``docs/bench/wan-roofline.md``: batch 1024, 12
encoder and 12 decoder layers, where a step's compute is large against one RTT) and ``electra``
(one way: token ids forward, a SYNC back per step, the generator ``sync_lag`` 1 step ahead; one
discriminator replica, since each cluster has one core).

    .venv/bin/python bench/wan/table3.py --out bench-results/table3          # make bench-wan-table3

Writes ``table3.json`` and ``table3.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from roofline import load, mean, pinned_deployment, run_job, use_receive_ahead  # bench/wan/roofline.py

INTRA = (10_000.0, 0.0)
"""The intra-cluster link: (Mbit/s, one-way ms) at which the emulator does not limit a job here."""


def jobs(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    return {
        "numbers": {
            "steps": args.steps,
            "data.batch_size": args.numbers_batch,
            "data.micro_batches": args.numbers_micro_batches,
            "pipeline.schedule": "gpipe",
            "pipeline.max_in_flight": args.numbers_micro_batches,
            **{f"stages.{i}.options.n_layers": n for i, n in enumerate(args.numbers_layers)},
        },
        "electra": {
            "steps": args.steps,
            "data.batch_size": args.batch_size,
            "data.micro_batches": 4,
            "stages.1.replicas": 1,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128, help="electra's batch")
    parser.add_argument(
        "--numbers-batch",
        type=int,
        default=1024,
        help="the numbers job's batch (1024: compute per step >> one RTT, docs/bench/wan-roofline.md)",
    )
    parser.add_argument("--numbers-micro-batches", type=int, default=8)
    parser.add_argument(
        "--numbers-layers",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[12, 12],
        help="encoder,decoder layers of the numbers job (the built-in job has 2,2)",
    )
    parser.add_argument("--bandwidth-mbit", type=float, default=60.0)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=2, help="runs per job and link (interleaved)")
    parser.add_argument("--jobs", type=lambda s: s.split(","), default=["numbers", "electra"])
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="leave the processes unpinned")
    parser.add_argument("--out", type=Path, default=Path("bench") / "results" / "table3")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    specs = jobs(args)
    unknown = [j for j in args.jobs if j not in specs]
    if unknown:
        parser.error(f"unknown job(s) {unknown}; expected {', '.join(specs)}")
    if args.pin and len(os.sched_getaffinity(0)) < 2:
        parser.error("pinning needs two CPUs (CPU 0 and CPU 1); pass --no-pin on a one-core machine")
    os.environ["NEBULA_TRAINER_TORCH_THREADS"] = "1"
    os.environ["OMP_NUM_THREADS"] = "1"
    use_receive_ahead("overlap")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    links = {"intra": INTRA, "inter": (args.bandwidth_mbit, args.delay_ms)}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        name: {"intra": [], "inter": []} for name in args.jobs
    }
    load_before = load()
    with contextlib.ExitStack() as stack:  # both deployments up at once, runs interleaved (module doc)
        sessions, pids = {}, {}
        for link, (bandwidth, delay) in links.items():
            run_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"table3-{link}-"))
            deployment = pinned_deployment(Path(run_dir), bandwidth, delay, args.pin)
            sessions[link], pids[link], _ = stack.enter_context(deployment)
        order = ["intra", "inter"]
        for repeat in range(args.repeats):
            for name in args.jobs:
                for link in order if repeat % 2 == 0 else order[::-1]:
                    before = load()
                    result = run_job(sessions[link], name, specs[name], args.warmup, pids[link])
                    result["samples_per_s"] = result["batch_size"] / result["step_s"]
                    result["load_before"] = before
                    runs[name][link].append(result)
                    line = {
                        "job": name,
                        "link": link,
                        "repeat": repeat,
                        "samples_per_s": result["samples_per_s"],
                    }
                    print(json.dumps(line), flush=True)
    loads = [load_before, load()]
    results = {
        name: {
            link: {"samples_per_s": mean([r["samples_per_s"] for r in rs]), "runs": rs}
            for link, rs in r.items()
        }
        for name, r in runs.items()
    }
    rows = [
        {
            "job": name,
            "intra_samples_per_s": r["intra"]["samples_per_s"],
            "inter_samples_per_s": r["inter"]["samples_per_s"],
            "ratio": r["inter"]["samples_per_s"] / r["intra"]["samples_per_s"],
        }
        for name, r in results.items()
    ]
    report = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "seconds": time.time() - started,
        "links": {k: {"bandwidth_mbit": v[0], "delay_ms": v[1]} for k, v in links.items()},
        "load_average": loads,
        "rows": rows,
        "results": results,
    }
    (args.out / "table3.json").write_text(json.dumps(report, indent=1))
    lines = [
        f"inter-cluster: {args.bandwidth_mbit:g} Mbit/s, {args.delay_ms:g} ms one-way; intra-cluster: "
        f"{INTRA[0]:g} Mbit/s, {INTRA[1]:g} ms; numbers: batch {args.numbers_batch}, "
        f"{args.numbers_micro_batches} micro-batches (GPipe), "
        f"layers (encoder, decoder) {args.numbers_layers}; "
        f"electra: batch {args.batch_size}; {args.steps} steps (first "
        f"{args.warmup} excluded); pinned: {args.pin}; {args.repeats} runs per job and link, interleaved "
        f"(intra, inter, inter, intra, ...), samples/s averaged. Load average (1/5/15 min) before "
        f"{loads[0]}, after {loads[1]}.",
        "",
        "| job | intra-cluster samples/s | inter-cluster samples/s | inter / intra |",
        "|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['job']} | {row['intra_samples_per_s']:.0f} | {row['inter_samples_per_s']:.0f} | "
            f"{row['ratio']:.2f} |"
        )
    lines += [
        "",
        "Every run (compute and wait: per step, of each stage; CPU: seconds per step of the WAN emulator "
        "and of the two switches):",
        "",
        "| job | link | samples/s | step ms | compute ms (stage: ms) | wait ms | emulator / switch CPU ms "
        "| load (1 min) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, per_link in results.items():
        for link, entry in per_link.items():
            for run in entry["runs"]:
                stages = run["stages"]
                compute = ", ".join(f"{s}: {1000 * v['compute_s']:.0f}" for s, v in sorted(stages.items()))
                wait = ", ".join(f"{s}: {1000 * v['wait_s']:.0f}" for s, v in sorted(stages.items()))
                cpu = run.get("cpu_seconds_per_step", {})
                used = " / ".join(
                    f"{1000 * cpu[n]:.0f}" if n in cpu else "?"
                    for n in ("wan-emulator", "switch-a", "switch-b")
                )
                lines.append(
                    f"| {name} | {link} | {run['samples_per_s']:.0f} | {1000 * run['step_s']:.0f} "
                    f"| {compute} | {wait} | {used} | {run['load_before'][0]} |"
                )
    text = "\n".join(lines) + "\n"
    (args.out / "table3.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
