"""Benchmark: step time and wait fractions of GPipe vs 1F1B across the emulated WAN, per micro-batch count.

Why a benchmark and not a test: speed depends on the machine; tests assert
correctness (split == unsplit), this script measures. It starts one local
two-cluster deployment, runs the built-in numbers job (the demo's) under each
setting, and writes a JSON report plus a Markdown table.

    .venv/bin/python bench/runtime/pipeline_schedules.py --steps 20 --out runs/bench-runtime
"""

from __future__ import annotations

import argparse
import json
import secrets
import time
from pathlib import Path

from nebula_common.jobspec import load_spec
from nebula_common.jobspec.builtin import builtin_spec
from nebula_common.launcher import LocalDeployment
from nebula_common.sdk.auth_client import AuthClient
from nebula_common.sdk.client import ClusterSession, submit_job
from nebula_common.sdk.jobs import ProgramJob
from nebula_common.sdk.summary import summarize


def login(deployment: LocalDeployment, cluster: str) -> ClusterSession:
    endpoints = deployment.endpoints(cluster)
    password = secrets.token_urlsafe(16)
    with AuthClient(endpoints.auth) as auth:
        admin = auth.login("admin", deployment.cluster_state[cluster].admin_password)
        auth.create_account(admin.token, f"bench-{cluster}", password)
    return ClusterSession.login(endpoints, f"bench-{cluster}", password)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--bandwidth-mbit", type=float, default=60.0)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=Path("runs") / "bench-runtime")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with LocalDeployment(
        run_dir=args.out / "deployment", bandwidth_mbit=args.bandwidth_mbit, delay_ms=args.delay_ms
    ) as deployment:
        sessions = {c: login(deployment, c) for c in ("a", "b")}
        for schedule in ("gpipe", "1f1b"):
            for micro_batches in (1, 2, 4, 8):
                overrides = {
                    "steps": args.steps,
                    "data.batch_size": args.batch_size,
                    "data.micro_batches": micro_batches,
                    "pipeline.schedule": schedule,
                    "pipeline.max_in_flight": 2,
                }
                job = ProgramJob(load_spec(builtin_spec("numbers"), overrides))
                started = time.perf_counter()
                summary = summarize(job, submit_job(job, sessions))
                wall = time.perf_counter() - started
                result = summary.to_json()
                steady = summary.step_seconds[2:] or summary.step_seconds  # skip warm-up steps
                rows.append(
                    {
                        "schedule": schedule,
                        "micro_batches": micro_batches,
                        "succeeded": summary.succeeded,
                        "mean_step_ms": 1000 * sum(steady) / len(steady),
                        "wait_fraction": result["wait_fraction"],
                        "final_loss": result["final_loss"],
                        "wall_seconds": wall,
                    }
                )
                print(json.dumps(rows[-1]))
    report = {
        "bandwidth_mbit": args.bandwidth_mbit,
        "delay_ms": args.delay_ms,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "rows": rows,
    }
    (args.out / "pipeline_schedules.json").write_text(json.dumps(report, indent=2))
    lines = [
        f"WAN {args.bandwidth_mbit:g} Mbit/s, {args.delay_ms:g} ms one-way; batch {args.batch_size}; "
        f"{args.steps} steps (first 2 excluded from the mean)",
        "",
        "| schedule | micro-batches | mean step ms | encoder wait | decoder wait | final loss |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        wait = row["wait_fraction"]
        lines.append(
            f"| {row['schedule']} | {row['micro_batches']} | {row['mean_step_ms']:.0f} | "
            f"{wait.get('encoder', 0):.0%} | {wait.get('decoder', 0):.0%} | {row['final_loss']:.4f} |"
        )
    (args.out / "pipeline_schedules.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
