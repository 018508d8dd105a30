"""Benchmark: how long the ELECTRA generator waits for the discriminator, by discriminator replicas.

Why: the paper's Figure 6 connects n discriminator devices to one generator so
the faster side does not idle. Here the generator (cluster a) waits only for
the per-step sync tensor (at most ``sync_lag`` steps behind) and on a full send
queue; this script measures that fraction of its step time for each replica
count and discriminator size on one local two-cluster deployment over the
emulated WAN, and writes JSON plus a Markdown table. All processes share this
machine's cores, so "balanced" means the sizes at which the discriminator's n
processes keep up with the generator here.

Wait fractions are reported twice: over all steps (what a job summary shows)
and in steady state, past the first ``WARMUP`` steps. They differ because the
replicas of a data-parallel stage are spawned (a fresh interpreter importing
torch and building the stage: seconds) while the generator already runs its
first ``sync_lag + 1`` steps; in a short run that one-off stall dominates the
all-steps number and says nothing about balance.

    .venv/bin/python bench/runtime/electra_wait.py --steps 30 --out runs/bench-electra
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from nebula_common.jobspec import load_spec
from nebula_common.jobspec.builtin import builtin_spec
from nebula_common.launcher import LocalDeployment
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.auth_client import AuthClient
from nebula_common.sdk.client import ClusterSession, JobHandle, submit_job
from nebula_common.sdk.jobs import ProgramJob

WARMUP = 3  # first steps: replica start-up, allocator warm-up


def login(deployment: LocalDeployment, cluster: str) -> ClusterSession:
    """A fresh account in ``cluster``, created by that cluster's own admin."""
    endpoints = deployment.endpoints(cluster)
    password = secrets.token_urlsafe(16)
    name = f"bench-electra-{cluster}"
    with AuthClient(endpoints.auth) as auth:
        admin = auth.login("admin", deployment.cluster_state[cluster].admin_password)
        auth.create_account(admin.token, name, password)
    return ClusterSession.login(endpoints, name, password)


@dataclass
class StageSteps:
    """One stage's per-step numbers, as its trainer reported them step by step."""

    wait: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    loss: float | None = None
    local_loss: float | None = None
    state: str = ""

    def wait_fraction(self, first: int = 0) -> float:
        total = sum(self.seconds[first:])
        return sum(self.wait[first:]) / total if total else 0.0


def follow(handle: JobHandle) -> dict[str, StageSteps]:
    """Per-stage, per-step wait and step time of a job, until both stages end."""
    stages: dict[str, StageSteps] = {}
    for update in handle.updates():
        status = update.status
        entry = stages.setdefault(status.stage, StageSteps())
        entry.state = trainer_pb2.StageState.Name(status.state).removeprefix("STAGE_STATE_")
        if status.steps_done > len(entry.seconds):
            entry.wait.append(status.wait_seconds)
            entry.seconds.append(status.step_seconds)
            if status.HasField("loss"):
                entry.loss = status.loss
            if status.HasField("local_loss"):
                entry.local_loss = status.local_loss
    return stages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--disc-layers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--gen-layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128, help="Width of both stages.")
    parser.add_argument("--sync-lag", type=int, default=1)
    parser.add_argument("--bandwidth-mbit", type=float, default=60.0)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=Path("runs") / "bench-electra")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with LocalDeployment(
        run_dir=args.out / f"deployment-{time.strftime('%Y%m%d-%H%M%S')}",
        bandwidth_mbit=args.bandwidth_mbit,
        delay_ms=args.delay_ms,
    ) as deployment:
        sessions = {c: login(deployment, c) for c in ("a", "b")}
        for layers in args.disc_layers:
            for replicas in args.replicas:
                overrides = {
                    "steps": args.steps,
                    "stages.1.replicas": replicas,
                    "stages.1.options.n_layers": layers,
                    "stages.0.options.n_layers": args.gen_layers,
                    "stages.0.options.d_model": args.d_model,
                    "stages.1.options.d_model": args.d_model,
                    "pipeline.sync_lag": args.sync_lag,
                }
                job = ProgramJob(load_spec(builtin_spec("electra"), overrides))
                started = time.perf_counter()
                stages = follow(submit_job(job, sessions))
                wall = time.perf_counter() - started
                gen, disc = stages["generator"], stages["discriminator"]
                steady = disc.seconds[WARMUP:] or disc.seconds
                rows.append(
                    {
                        "disc_layers": layers,
                        "replicas": replicas,
                        "succeeded": gen.state == disc.state == "SUCCEEDED",
                        "generator_wait_fraction": gen.wait_fraction(),
                        "discriminator_wait_fraction": disc.wait_fraction(),
                        "generator_wait_fraction_steady": gen.wait_fraction(WARMUP),
                        "discriminator_wait_fraction_steady": disc.wait_fraction(WARMUP),
                        "generator_wait_seconds_first_steps": sum(gen.wait[:WARMUP]),
                        "mean_step_ms": 1000 * sum(steady) / len(steady),
                        "final_rtd_loss": disc.loss,
                        "final_mlm_loss": gen.local_loss,
                        "wall_seconds": wall,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    report = {
        "cpus": os.cpu_count(),
        "bandwidth_mbit": args.bandwidth_mbit,
        "delay_ms": args.delay_ms,
        "steps": args.steps,
        "sync_lag": args.sync_lag,
        "generator": {"d_model": args.d_model, "n_layers": args.gen_layers},
        "rows": rows,
    }
    (args.out / "electra_wait.json").write_text(json.dumps(report, indent=2))
    lines = [
        f"ELECTRA one-way, WAN {args.bandwidth_mbit:g} Mbit/s, {args.delay_ms:g} ms one-way; "
        f"{args.steps} steps, sync lag {args.sync_lag}; generator {args.gen_layers} layers, width "
        f"{args.d_model} (discriminator same width); {os.cpu_count()} CPUs shared by every process; "
        f"wait fractions over all steps and in steady state (steps >= {WARMUP}); generator wait in "
        f"steps < {WARMUP} (replica start-up) in seconds",
        "",
        "| disc layers | replicas | gen wait all | gen wait steady | gen wait s (start) | discr. wait all "
        "| discr. wait steady | mean step ms | RTD loss | MLM loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['disc_layers']} | {row['replicas']} | {row['generator_wait_fraction']:.1%} | "
            f"{row['generator_wait_fraction_steady']:.1%} | "
            f"{row['generator_wait_seconds_first_steps']:.2f} | "
            f"{row['discriminator_wait_fraction']:.1%} | {row['discriminator_wait_fraction_steady']:.1%} | "
            f"{row['mean_step_ms']:.0f} | "
            f"{row['final_rtd_loss']:.4f} | {row['final_mlm_loss']:.4f} |"
        )
    (args.out / "electra_wait.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
