"""Benchmark: how close a split job's step comes to its roofline max(compute, transfer), pinned cores.

Why: the point of the overlapped step pipeline (receive thread decoding ahead, sender thread
encoding, see ``services/trainer/runtime/transfer.py``) is that a step costs the larger of the
compute and the WAN transfer, not their sum. This measures it on a real local two-cluster
deployment (every service its own process, the WAN emulator between the switches) with each
cluster's processes pinned to a core of its own (cluster a: CPU 0, cluster b: CPU 1; every
thread of every process, one torch thread each), for 1, 2, 4, 8 micro-batches under GPipe and
1F1B, side by side with the serial path (``NEBULA_TRAINER_RECEIVE_AHEAD=0``: receive and decode
on the stage thread) in the same run: one deployment per path, both up, each configuration run on
both back to back.

Per run (the built-in ``numbers`` job, steady steps only, the first ``--warmup`` excluded):

* ``step``: mean step seconds of the loss-owning (decoder) stage;
* ``compute``: the larger of the two stages' mean compute seconds per step (stage thread busy:
  step minus time blocked on the other cluster; measured in the same run, so under its load);
* ``transfer``: the larger direction's payload bytes per step (each stage's edge counts) at the
  emulated bandwidth;
* ``ratio = step / max(compute, transfer)``; ``rtt`` = 2 x one-way delay, the part of every step
  the schedule cannot hide (the upstream's next forward needs this step's last gradient).

    .venv/bin/python bench/wan/roofline.py --out bench-results/roofline        # make bench-wan-roofline

Defaults: the paper's regime (batch 1024, 12 encoder + 12 decoder layers, 8 steps; ~10 min), where a
step's compute (~2.5 s on one core) is large against one RTT; the demo's job: ``--batch-size 128
--layers 2,2 --steps 12`` (~6 min). See ``docs/bench/wan-roofline.md``.

Writes ``roofline.json``, ``roofline.md`` and ``roofline.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))

from common import PALETTE, Canvas, Plot  # bench/faults/common.py: a PNG without matplotlib

from nebula_common.jobspec import load_spec
from nebula_common.jobspec.builtin import builtin_spec
from nebula_common.launcher import LocalDeployment
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.auth_client import AuthClient
from nebula_common.sdk.client import ClusterSession, submit_job
from nebula_common.sdk.jobs import ProgramJob
from nebula_common.sdk.summary import summarize

MODES = {"overlap": None, "serial": "0"}
"""Deployment variants: NEBULA_TRAINER_RECEIVE_AHEAD for the trainers (None: the default depth)."""


def login(deployment: LocalDeployment, cluster: str) -> ClusterSession:
    endpoints = deployment.endpoints(cluster)
    password = secrets.token_urlsafe(16)
    with AuthClient(endpoints.auth) as auth:
        admin = auth.login("admin", deployment.cluster_state[cluster].admin_password)
        auth.create_account(admin.token, f"bench-{cluster}", password)
    return ClusterSession.login(endpoints, f"bench-{cluster}", password)


def pin_cluster(deployment: LocalDeployment, cluster: str, cpu: int) -> list[int]:
    """Every thread of every process of ``cluster`` onto ``cpu`` (threads made later inherit it)."""
    pids = [p.pid for p in deployment.cluster_state[cluster].processes() if p.pid is not None]
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(int(tid), {cpu})
    return pids


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def windows_logged(log_dir: Path | None, job_id: str) -> list[dict[str, Any]]:
    """The 1F1B windows the encoder's trainer chose for ``job_id`` (its "1f1b window sized" log lines)."""
    path = None if log_dir is None else log_dir / "trainer-a.log"
    if path is None or not path.exists():
        return []
    found = []
    for line in path.read_text(errors="replace").splitlines():
        if "1f1b window sized" not in line:
            continue
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if entry.get("job_id") == job_id:
                keys = ("step", "window", "gradient_latency_ms", "compute_per_micro_batch_ms")
                found.append({k: entry.get(k) for k in keys})
    return found


def run_job(
    sessions: dict[str, ClusterSession],
    builtin: str,
    overrides: dict[str, Any],
    warmup: int,
    pids: dict[str, int] | None = None,
    log_dir: Path | None = None,
) -> dict[str, Any]:
    """Run one built-in job to its end; per stage, its steady per-step means (steps after ``warmup``).

    With ``pids``: also each process's CPU seconds per step over the whole job (where the cores went).
    With ``log_dir`` (the deployment's logs): the 1F1B windows the encoder's trainer chose.
    """
    cpu_before = cpu_seconds(pids or {})
    job = ProgramJob(load_spec(builtin_spec(builtin), overrides))
    steps = int(overrides["steps"])
    per_stage: dict[str, dict[int, trainer_pb2.StageStatus]] = {}
    # CPU over the steady steps only (start-up and warm-up excluded): sampled when a stage first
    # reports the warm-up's last step and when one first reports the job's last step.
    cpu_marks: dict[int, tuple[str, dict[str, float]]] = {}

    def on_status(status: trainer_pb2.StageStatus) -> None:
        if status.steps_done > 0 and status.step_seconds > 0:
            copy = trainer_pb2.StageStatus()
            copy.CopyFrom(status)
            per_stage.setdefault(status.stage, {})[int(status.steps_done)] = copy
            done = int(status.steps_done)
            if pids and done in (warmup, steps) and done not in cpu_marks:
                cpu_marks[done] = (status.stage, cpu_seconds(pids))

    summary = summarize(job, submit_job(job, sessions), on_status=on_status)
    if not summary.succeeded:
        raise RuntimeError(f"job failed: {summary.stage_messages}")
    steady = range(warmup + 1, steps + 1)
    stages: dict[str, dict[str, float]] = {}
    for stage, statuses in per_stage.items():
        rows = [statuses[s] for s in steady if s in statuses]
        first, last = statuses.get(warmup), statuses.get(steps)
        sent = (last.bytes_sent - first.bytes_sent) / len(steady) if first and last else 0.0
        stages[stage] = {
            "step_s": mean([r.step_seconds for r in rows]),
            "compute_s": mean([r.compute_seconds for r in rows]),
            "wait_s": mean([r.wait_seconds for r in rows]),
            "bytes_sent_per_step": sent,
        }
    loss_steps = summary.step_seconds[warmup:]  # the loss-owning stage's steps
    cpu_after = cpu_seconds(pids or {})
    cpu = {name: (cpu_after[name] - cpu_before[name]) / steps for name in cpu_after if name in cpu_before}
    steady_cpu: dict[str, float] = {}
    if warmup in cpu_marks and steps in cpu_marks and cpu_marks[warmup][0] == cpu_marks[steps][0]:
        first, last = cpu_marks[warmup][1], cpu_marks[steps][1]
        steady_cpu = {n: (last[n] - first[n]) / (steps - warmup) for n in last if n in first}
    return {
        "step_s": mean(loss_steps),
        "cpu_seconds_per_step": cpu,
        "steady_cpu_seconds_per_step": steady_cpu,
        "stages": stages,
        "final_loss": summary.losses[-1],
        "batch_size": job.spec.data.batch_size,
        "windows": windows_logged(log_dir, job.job_id),
    }


def roofline_row(
    sessions: dict[str, ClusterSession],
    args: argparse.Namespace,
    schedule: str,
    micro_batches: int,
    pids: dict[str, int] | None = None,
    log_dir: Path | None = None,
) -> dict[str, Any]:
    cap = max(2, micro_batches // 2) if args.max_in_flight == "half" else micro_batches
    overrides = {
        "steps": args.steps,
        "data.batch_size": args.batch_size,
        "data.micro_batches": micro_batches,
        "pipeline.schedule": schedule,
        "pipeline.max_in_flight": cap,
        **{f"stages.{i}.options.n_layers": n for i, n in enumerate(args.layers)},
    }
    result = run_job(sessions, "numbers", overrides, args.warmup, pids, log_dir)
    stages = result["stages"]
    step = result["step_s"]
    compute = max(s["compute_s"] for s in stages.values())
    transfer = max(s["bytes_sent_per_step"] for s in stages.values()) * 8 / (args.bandwidth_mbit * 1e6)
    return {
        "schedule": schedule,
        "micro_batches": micro_batches,
        "step_ms": 1000 * step,
        "compute_ms": 1000 * compute,
        "transfer_ms": 1000 * transfer,
        "rtt_ms": 2 * args.delay_ms,
        "ratio": step / max(compute, transfer),
        "ratio_without_rtt": (step - 2 * args.delay_ms / 1000) / max(compute, transfer),
        "stages": stages,
        "cpu_seconds_per_step": result["cpu_seconds_per_step"],
        "steady_cpu_seconds_per_step": result["steady_cpu_seconds_per_step"],
        "final_loss": result["final_loss"],
        "max_in_flight": cap,
        "windows": result["windows"],
    }


@contextlib.contextmanager
def pinned_deployment(
    run_dir: Path, bandwidth_mbit: float, delay_ms: float, pin: bool
) -> Iterator[tuple[dict[str, ClusterSession], dict[str, int], Path]]:
    """A local two-cluster deployment (a on CPU 0, b on CPU 1 if ``pin``), a session per cluster,
    every process's pid by name (``trainer-a``, ``switch-b``, ``wan-emulator``, ...; the emulator is
    never pinned: it stands for the network between the clusters) and its log directory."""
    with LocalDeployment(run_dir=run_dir, bandwidth_mbit=bandwidth_mbit, delay_ms=delay_ms) as deployment:
        if pin:
            pin_cluster(deployment, "a", 0)
            pin_cluster(deployment, "b", 1)
        processes = [p for state in deployment.cluster_state.values() for p in state.processes()]
        if deployment.emulator is not None:
            processes.append(deployment.emulator)
        pids = {p.name: p.pid for p in processes if p.pid is not None}
        yield {c: login(deployment, c) for c in ("a", "b")}, pids, deployment.log_dir


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds each process (all its threads) has used so far (/proc/PID/stat)."""
    tick = os.sysconf("SC_CLK_TCK")
    used = {}
    for name, pid in pids.items():
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            used[name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return used


def use_receive_ahead(mode: str) -> None:
    """Set NEBULA_TRAINER_RECEIVE_AHEAD for the trainers of the next deployment (``MODES``)."""
    ahead = MODES[mode]
    if ahead is None:
        os.environ.pop("NEBULA_TRAINER_RECEIVE_AHEAD", None)
    else:
        os.environ["NEBULA_TRAINER_RECEIVE_AHEAD"] = ahead


def run_modes(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (schedule, micro-batches) on one deployment per mode, all up at once, modes interleaved.

    The machine is shared and its load drifts over minutes; running each configuration on every
    mode back to back (in alternating order) keeps the comparison side by side. Idle deployments
    cost next to nothing. The trainers read NEBULA_TRAINER_RECEIVE_AHEAD when they start.
    """
    parts: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        sessions, pids, logs = {}, {}, {}
        for mode in args.modes:
            use_receive_ahead(mode)
            run_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"roofline-{mode}-"))
            deployment = pinned_deployment(Path(run_dir), args.bandwidth_mbit, args.delay_ms, args.pin)
            sessions[mode], pids[mode], logs[mode] = stack.enter_context(deployment)
            parts[mode] = {"mode": mode, "pids": pids[mode], "load_before": load(), "rows": []}
        configs = [(s, m) for s in args.schedules for m in args.micro_batches]
        for index, (schedule, micro_batches) in enumerate(configs):
            for mode in args.modes if index % 2 == 0 else args.modes[::-1]:
                before = load()
                row = roofline_row(sessions[mode], args, schedule, micro_batches, pids[mode], logs[mode])
                row.update(mode=mode, load_before=before, load_after=load())
                parts[mode]["rows"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "stages"}), flush=True)
        for part in parts.values():
            part["load_after"] = load()
    return [parts[mode] for mode in args.modes]


def render_png(path: Path, rows: list[dict[str, Any]]) -> None:
    """Ratio (y, 1.0 to the worst) over micro-batches (x, 1..8, log2 spaced), one line per mode+schedule.

    Colours: overlap gpipe blue, overlap 1f1b green, serial gpipe red, serial 1f1b orange; the
    grey line is ratio 1.0 (the roofline), the black one 1.15 (the target at 8 micro-batches).
    """
    canvas = Canvas(800, 480)
    counts = sorted({r["micro_batches"] for r in rows})
    top = max([r["ratio"] for r in rows] + [1.2]) * 1.05
    plot = Plot(canvas, (50, 20, 780, 460), (-0.2, len(counts) - 0.8), (0.9, top))
    for level, colour in ((1.0, "grey"), (1.15, "black")):
        plot.points([(plot.xr[0], level), (plot.xr[1], level)], PALETTE[colour], r=0, join=True)
    plot.xticks(1.0)
    colours = {
        ("overlap", "gpipe"): "blue",
        ("overlap", "1f1b"): "green",
        ("serial", "gpipe"): "red",
        ("serial", "1f1b"): "orange",
    }
    for (mode, schedule), colour in colours.items():
        points = [
            (counts.index(r["micro_batches"]), r["ratio"])
            for r in rows
            if r["mode"] == mode and r["schedule"] == schedule
        ]
        plot.points(sorted(points), PALETTE[colour], r=3, join=True)
    canvas.save(path)


def floor_ms(row: dict[str, Any]) -> float:
    """What a synchronous two-stage pipeline cannot beat, however well it overlaps.

    The loss stage's last micro-batch must finish, its gradient cross, the upstream apply it and
    step, and the next step's first activation cross before the bottleneck stage can start its
    next step: max(compute, transfer) + the other stage's compute of one micro-batch (its
    fill/drain) + one RTT + one micro-batch's transfer each way (the last gradient and the first
    activation, each serialised at the link's rate; the emulator lends an idle link only one
    segment) (stages' compute from the same run).
    """
    computes = sorted(1000 * s["compute_s"] for s in row["stages"].values())
    other = computes[0] if len(computes) > 1 else 0.0
    bound = max(row["compute_ms"], row["transfer_ms"])
    crossing = 2 * row["transfer_ms"] / row["micro_batches"]
    return bound + other / row["micro_batches"] + row["rtt_ms"] + crossing


def cpu_columns(row: dict[str, Any]) -> str:
    """The trainers' CPU ms per step (a / b) and step / max(the larger, transfer).

    Steady steps only where measured (``steady_cpu_seconds_per_step``); otherwise over the whole
    job, start-up included (marked "job"), which overstates CPU per step and so understates this
    ratio. Against the wall-clock compute of the ratio column, the difference is what else ran
    on the cluster's core while the stage computed (its switch, codec, the unpinned emulator).
    """
    cpu, scope = row.get("steady_cpu_seconds_per_step") or {}, ""
    if not cpu:
        cpu, scope = row.get("cpu_seconds_per_step") or {}, " (job)"
    if "trainer-a" not in cpu or "trainer-b" not in cpu:
        return "? | ?"
    a, b = 1000 * cpu["trainer-a"], 1000 * cpu["trainer-b"]
    return f"{a:.0f} / {b:.0f}{scope} | {row['step_ms'] / max(a, b, row['transfer_ms']):.2f}"


def window(row: dict[str, Any]) -> str:
    """1F1B's activations in flight: the windows chosen over the job (first -> last), of max_in_flight."""
    if row["schedule"] != "1f1b":
        return "-"
    chosen = [w["window"] for w in row.get("windows", [])]
    cap = row.get("max_in_flight", "?")
    if not chosen:
        return f"{cap} (fixed)"
    path = "->".join(str(w) for w in chosen)
    return f"{path} of {cap}"


def markdown(report: dict[str, Any]) -> str:
    args = report["args"]
    lines = [
        f"WAN {args['bandwidth_mbit']:g} Mbit/s, {args['delay_ms']:g} ms one-way "
        f"(RTT {2 * args['delay_ms']:g} ms); `numbers` job, batch {args['batch_size']}, "
        f"{args['steps']} steps (first {args['warmup']} excluded); "
        f"layers (encoder, decoder) {args.get('layers', [2, 2])}; max_in_flight: "
        f"{args.get('max_in_flight', 'half')}; "
        f"clusters pinned to CPU 0 / CPU 1: {args['pin']}; one torch thread per trainer.",
        "",
    ]
    for part in report["modes"]:
        lines.append(
            f"- {part['mode']}: load average (1/5/15 min) before {part['load_before']}, "
            f"after {part['load_after']}"
        )
    lines += [
        "",
        "| schedule | micro-batches | path | step ms | encoder / decoder compute ms | transfer ms "
        "| **ratio** | ratio - RTT | pipeline floor ms | step / floor | 1F1B window | trainer CPU ms a / b "
        "| ratio on CPU | load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [r for part in report["modes"] for r in part["rows"]]
    schedules = list(dict.fromkeys(r["schedule"] for r in rows))
    rows.sort(key=lambda r: (schedules.index(r["schedule"]), r["micro_batches"]))  # paths side by side
    for r in rows:
        stages = r["stages"]
        per_stage = " / ".join(f"{1000 * stages[n]['compute_s']:.0f}" for n in ("encoder", "decoder"))
        floor = floor_ms(r)
        lines.append(
            f"| {r['schedule']} | {r['micro_batches']} | {r['mode']} | {r['step_ms']:.0f} | "
            f"{per_stage} | {r['transfer_ms']:.0f} | **{r['ratio']:.2f}** | "
            f"{r['ratio_without_rtt']:.2f} | {floor:.0f} | {r['step_ms'] / floor:.2f} | {window(r)} | "
            f"{cpu_columns(r)} | {r.get('load_before', ['?'])[0]} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=1024,
        help="with --layers 12,12: compute per step >> one RTT, the paper's regime (the demo's: 128, 2,2)",
    )
    parser.add_argument("--bandwidth-mbit", type=float, default=60.0)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument(
        "--micro-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8]
    )
    parser.add_argument("--schedules", type=lambda s: s.split(","), default=["gpipe", "1f1b"])
    parser.add_argument("--modes", type=lambda s: s.split(","), default=["overlap", "serial"])
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="leave the processes unpinned")
    parser.add_argument(
        "--max-in-flight",
        choices=("micro-batches", "half"),
        default="micro-batches",
        help="the jobs' pipeline.max_in_flight: the step's micro-batches (1F1B then holds what covers "
        "the measured round trip, see schedule.covering_window) or max(2, micro-batches / 2)",
    )
    parser.add_argument(
        "--layers",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[12, 12],
        help="encoder,decoder transformer layers (n_layers of each stage; the built-in job has 2,2)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench") / "results" / "roofline")
    parser.add_argument("--render", type=Path, help="only rewrite the markdown and PNG from this JSON")
    args = parser.parse_args()
    if args.render is not None:
        report = json.loads(args.render.read_text())
        args.render.with_suffix(".md").write_text(markdown(report))
        render_png(args.render.with_suffix(".png"), [r for part in report["modes"] for r in part["rows"]])
        print(markdown(report))
        return
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; expected {', '.join(MODES)}")
    if args.pin and len(os.sched_getaffinity(0)) < 2:
        parser.error("pinning needs two CPUs (CPU 0 and CPU 1); pass --no-pin on a one-core machine")
    os.environ["NEBULA_TRAINER_TORCH_THREADS"] = "1"  # one core per cluster: one torch thread
    os.environ["OMP_NUM_THREADS"] = "1"  # ... on every thread (decode and encode run on their own)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    modes = run_modes(args)
    report = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "seconds": time.time() - started,
        "modes": modes,
    }
    (args.out / "roofline.json").write_text(json.dumps(report, indent=1))
    text = markdown(report)
    (args.out / "roofline.md").write_text(text)
    render_png(args.out / "roofline.png", [r for part in modes for r in part["rows"]])
    print(text)


if __name__ == "__main__":
    main()
