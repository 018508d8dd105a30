"""A small job beside a big one: does the big neighbour's traffic stall the small job?

One two-cluster deployment (``LocalDeployment``, 60 Mbit/s, 20 ms each way). Two accounts:

* ``small``: ``examples/digit_sum`` (a few KiB per micro-batch);
* ``big``: ``big_neighbour/job.yaml``, a legitimate job that sends 4 MiB per micro-batch forward and
  4 MiB of gradients back, codec none: it alone can fill the link.

Per round, side by side: the small job alone, the big job alone, the big job with the small job beside
it on the same link, and (the control) the small job beside a big job that runs on a second deployment
of its own: the same CPUs, another link. Reported: the small job's mean step beside the big one against
alone (the ratio a tenant feels), the same for the control (what sharing two cores costs it, which no
switch can remove), and the big job's step in the mix against alone (what it keeps of the link), with
its own control: its step beside the small job running on the other deployment (what the small job's
CPU costs it). Step
times are the trainers' own (``StageStatus.step_seconds``), steps after the second. While the big job
runs alone, from its second step to its end, the CPU of the two switches and the WAN emulator (each
process tree's user + system time in ``/proc``, in cores): what its bytes cost the data path.

Usage: ``python bench/faults/neighbour.py [--out DIR] [--rounds N] [--small-steps N]``; writes
``faults-neighbour.json`` and ``.md``. ``--quick`` (one round, fewer steps) fails when the small job's
ratio exceeds 2 or the big job keeps less than 0.8 of its throughput (without pacing the ratio is 10).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import JobFollower, load_info, md_table, tree_cpu_seconds, wait_until, write_json

from bench.wan.utilisation import switch_connections
from nebula_common.jobspec import load_spec
from nebula_common.launcher import LocalDeployment
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.client import ClusterSession, submit_job
from nebula_common.sdk.jobs import ProgramJob
from tests.support.accounts import make_user

ROOT = Path(__file__).resolve().parents[2]
SMALL_SPEC = ROOT / "examples" / "digit_sum" / "job.yaml"
BIG_SPEC = Path(__file__).resolve().parent / "big_neighbour" / "job.yaml"
BANDWIDTH_MBIT, DELAY_MS = 60.0, 20.0
BIG_BYTES_PER_STEP = 4 * (4 << 20)  # each way: 4 micro-batches x 4 MiB
TIMEOUT_S = 900.0
SUCCEEDED = trainer_pb2.STAGE_STATE_SUCCEEDED


def job(spec: Path, label: str, steps: int) -> ProgramJob:
    loaded = load_spec(spec, {"steps": steps, "checkpoint.interval": steps})
    return ProgramJob(loaded, f"{label}-{int(time.time() * 1000) % 10**8}")


def follow(program: ProgramJob, sessions: dict[str, ClusterSession]) -> tuple[Any, JobFollower]:
    handle = submit_job(program, sessions)
    return handle, JobFollower(handle.job.job_id, handle.stages, give_up_s=TIMEOUT_S)


def stop_if_ended(follower: JobFollower, what: str) -> None:
    """A stage that ended otherwise than succeeded (a trainer that could not start it, say) fails the bench
    at once: the job's other stages may wait for their peer until the bench's timeout."""
    ended = {stage: status.message for stage, status in follower.final.items() if status.state != SUCCEEDED}
    if ended:
        raise SystemExit(f"{what} ended early: {ended}")


def finished(follower: JobFollower, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not follower.wait(1.0):
        stop_if_ended(follower, what)
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not finish within {TIMEOUT_S:.0f} s")
    states = {o["state"] for o in follower.outcome().values()}
    if states != {"succeeded"}:
        raise SystemExit(f"{what} ended {states}: {follower.outcome()}")


def reported_between(follower: JobFollower, stage: str, start: float, end: float) -> list[float]:
    """Step wall times the trainer reported for steps completed inside [start, end] (monotonic)."""
    return [
        follower.reported[stage][step]
        for step, at in sorted(follower.steps[stage].items())
        if start <= at <= end and step in follower.reported[stage] and step > 2
    ]


def beside_big(
    small_users: dict[str, ClusterSession], big_users: dict[str, ClusterSession], small_steps: int, label: str
) -> tuple[float, list[float]]:
    """The small job's mean step while a big job streams (on ``big_users``' deployment), and the big
    job's step times meanwhile."""
    big_handle, big = follow(job(BIG_SPEC, f"big-{label}", 100_000), big_users)
    deadline = time.monotonic() + TIMEOUT_S
    while big.done_steps("sink") < 3:  # the big job is streaming before the small one starts
        stop_if_ended(big, f"the big job ({label})")
        if time.monotonic() > deadline:
            raise SystemExit("the big job did not reach its third step")
        time.sleep(0.2)
    started = time.monotonic()
    _, small = follow(job(SMALL_SPEC, f"small-{label}", small_steps), small_users)
    finished(small, f"the small job beside the big one ({label})")
    ended = time.monotonic()
    big_handle.cancel()
    big.wait(60)
    mean = small.mean_reported_step_seconds("head")
    if not mean:
        raise SystemExit(f"the small job reported no step time ({label})")
    return mean, reported_between(big, "sink", started, ended)


def path_cpu(deployment: LocalDeployment) -> tuple[float, dict[str, float]]:
    """When, and the CPU seconds so far of each switch and the WAN emulator(s) (by role)."""
    used: dict[str, float] = {}
    roles = {"switch-": "switches", "wan-emulator": "emulator"}
    for process in deployment.all_processes():
        role = next((role for prefix, role in roles.items() if process.name.startswith(prefix)), None)
        if role is not None and process.pid:
            used[role] = used.get(role, 0.0) + tree_cpu_seconds(process.pid)
    return time.monotonic(), used


def cores(start: tuple[float, dict[str, float]], end: tuple[float, dict[str, float]]) -> dict[str, float]:
    seconds = max(end[0] - start[0], 1e-9)
    return {role: round((end[1][role] - start[1].get(role, 0.0)) / seconds, 3) for role in end[1]}


def one_round(
    deployment: LocalDeployment,
    users: dict[str, dict[str, ClusterSession]],
    control_users: dict[str, ClusterSession],
    small_steps: int,
    big_steps: int,
) -> dict[str, Any]:
    _, small = follow(job(SMALL_SPEC, "small-alone", small_steps), users["small"])
    finished(small, "the small job alone")
    small_alone = small.mean_reported_step_seconds("head")
    _, big = follow(job(BIG_SPEC, "big-alone", big_steps), users["big"])
    wait_until(lambda: big.done_steps("sink") >= 2 or big.final, TIMEOUT_S, "the big job's second step")
    path_start = path_cpu(deployment)
    finished(big, "the big job alone")
    path_end = path_cpu(deployment)
    big_alone = big.mean_reported_step_seconds("sink")
    # The dialing switch's connection count (its default, `auto`, may add some for a link-bound job).
    connections_url = deployment.endpoints("a").metrics.get("switch-a", "")
    connections_alone = switch_connections(connections_url)
    small_mix, big_steps_mix = beside_big(users["small"], users["big"], small_steps, "mix")
    connections_mix = switch_connections(connections_url)
    small_control, big_steps_control = beside_big(users["small"], control_users, small_steps, "control")
    big_mix = statistics.mean(big_steps_mix) if big_steps_mix else None
    big_control = statistics.mean(big_steps_control) if big_steps_control else None
    if not (small_alone and big_alone):
        raise SystemExit(f"a step time is missing: {small_alone=} {big_alone=}")
    return {
        "small_alone_s": round(small_alone, 4),
        "small_mix_s": round(small_mix, 4),
        "small_ratio": round(small_mix / small_alone, 3),
        "small_control_s": round(small_control, 4),
        "control_ratio": round(small_control / small_alone, 3),
        "big_alone_s": round(big_alone, 4),
        "big_mix_s": round(big_mix, 4) if big_mix else None,
        "big_mix_steps": len(big_steps_mix),
        "big_share": round(big_alone / big_mix, 3) if big_mix else None,
        "big_control_s": round(big_control, 4) if big_control else None,
        "big_control_share": round(big_alone / big_control, 3) if big_control else None,
        "big_alone_mbit_each_way": round(BIG_BYTES_PER_STEP * 8 / big_alone / 1e6, 1),
        "big_alone_cores": cores(path_start, path_end),
        "link_connections": [connections_alone, connections_mix],
        "load": load_info(),
    }


def report(result: dict[str, Any]) -> str:
    rows = [
        [
            i + 1,
            r["small_alone_s"],
            r["small_mix_s"],
            r["small_ratio"],
            r["small_control_s"],
            r["control_ratio"],
            r["big_alone_s"],
            r["big_mix_s"],
            r["big_share"],
            r["big_control_s"],
            r["big_control_share"],
            r["big_alone_mbit_each_way"],
            r["big_alone_cores"].get("switches"),
            r["big_alone_cores"].get("emulator"),
            " / ".join("-" if c is None else f"{c:g}" for c in r["link_connections"]),
        ]
        for i, r in enumerate(result["rounds"])
    ]
    head = [
        "round",
        "small alone s",
        "beside big s",
        "ratio",
        "beside big elsewhere s",
        "CPU-only ratio",
        "big alone s",
        "big beside s",
        "big keeps",
        "big beside small elsewhere s",
        "big keeps, CPU only",
        "big alone Mbit/s each way",
        "big alone: switches' cores",
        "emulator's cores",
        "link connections after big alone / beside",
    ]
    return (
        f"# Small job beside a big neighbour ({BANDWIDTH_MBIT:g} Mbit/s, {DELAY_MS:g} ms each way)\n\n"
        + md_table(head, rows)
        + f"\n\nMedian ratio: **{result['median_small_ratio']}** (CPU-only control: "
        f"{result['median_control_ratio']}); the big job keeps **{result['median_big_share']}** of its "
        f"alone throughput (CPU-only control: {result['median_big_control_share']}). Alone, its bytes "
        f"cost the two switches **{result['median_switch_cores']}** cores and the WAN emulator "
        f"{result['median_emulator_cores']} (medians).\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--small-steps", type=int, default=40)
    parser.add_argument("--big-steps", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="one short round: a smoke check")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.small_steps, args.big_steps = 1, 20, 5
    run_dir = args.out / "run-faults-neighbour"
    for old in (run_dir, run_dir.with_name(run_dir.name + "-control")):
        if old.exists():
            shutil.rmtree(old)
    rounds = []
    shape = {"bandwidth_mbit": BANDWIDTH_MBIT, "delay_ms": DELAY_MS}
    with (
        LocalDeployment(run_dir=run_dir, **shape) as deployment,  # type: ignore[arg-type]
        LocalDeployment(run_dir=run_dir.with_name(run_dir.name + "-control"), **shape) as control,  # type: ignore[arg-type]
    ):
        users = {u: {c: make_user(deployment, c, u) for c in ("a", "b")} for u in ("small", "big")}
        control_users = {c: make_user(control, c, "big") for c in ("a", "b")}
        for k in range(args.rounds):
            rounds.append(one_round(deployment, users, control_users, args.small_steps, args.big_steps))
            print(f"round {k + 1}: {rounds[-1]}", flush=True)
    result = {
        "bandwidth_mbit": BANDWIDTH_MBIT,
        "delay_ms": DELAY_MS,
        "rounds": rounds,
        "median_small_ratio": statistics.median(r["small_ratio"] for r in rounds),
        "median_control_ratio": statistics.median(r["control_ratio"] for r in rounds),
        "median_big_share": statistics.median(r["big_share"] or 0.0 for r in rounds),
        "median_big_control_share": statistics.median(r["big_control_share"] or 0.0 for r in rounds),
        "median_switch_cores": statistics.median(r["big_alone_cores"].get("switches", 0.0) for r in rounds),
        "median_emulator_cores": statistics.median(r["big_alone_cores"].get("emulator", 0.0) for r in rounds),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "faults-neighbour.json", result)
    (args.out / "faults-neighbour.md").write_text(report(result))
    print(report(result))
    if args.quick and (result["median_small_ratio"] > 2.0 or result["median_big_share"] < 0.8):
        raise SystemExit(
            f"quick check failed: ratio {result['median_small_ratio']} (at most 2), big job keeps "
            f"{result['median_big_share']} (at least 0.8)"
        )


if __name__ == "__main__":
    main()
