"""Fault timeline of one job: WAN cuts and switch kills mid-job, each with its recovery time.

One two-cluster deployment (``LocalDeployment``, supervised: a killed service is restarted). The built-in
``numbers`` job runs twice with the same spec: once undisturbed (the reference), once through

1. a 10 s cut (``wan.cut()`` + ``wan.reset_connections()``, so both switches really lose the link, then
   ``wan.restore()``),
2. a 60 s cut (the same),
3. ``kill -9`` of cluster a's switch (the supervisor restarts it),
4. ``kill -9`` of cluster b's switch,

each fault a few steps after the job recovered from the previous one. Recovery time = from the end of
the fault (restore, or the supervisor reporting the switch running again) to the next step the job
completes. Lost / applied-twice micro-batches are measured, not assumed: a lost or duplicated micro-batch
changes the parameters, so both stages' final checkpoints and the per-step losses are compared with the
reference run (equal => 0 lost, 0 applied twice).

Then, each in a job of its own, ``kill -9`` of cluster a's and of cluster b's trainer: the supervisor
restarts it, it resumes its stage from its on-disk record at the next epoch, and both stages restart
from the last checkpoint both hold; recovery time and exactly-once (every reported loss and the final
parameters bit-identical to the reference run) are measured per job.

Usage: ``python bench/faults/timeline.py [--out DIR] [--steps N]``; writes faults-timeline.json/.md/.png.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    PALETTE,
    Canvas,
    JobFollower,
    Plot,
    ProcessSampler,
    load_info,
    md_table,
    wait_until,
    write_json,
)

from nebula_common.launcher import LocalDeployment
from nebula_common.sdk.client import ClusterSession, submit_job
from tests.support.accounts import make_user
from tests.support.jobs import numbers_job

BANDWIDTH_MBIT, DELAY_MS = 60.0, 20.0
STAGES = (("a", "encoder"), ("b", "decoder"))
GAP_STEPS = 3  # steps completed after a recovery before the next fault
TRAINER_KILL_WAIT_S = 150.0
RECOVERY_WAIT_S = 180.0  # how long after a fault's end both stages may take to step again
FINISH_TIMEOUT_S = 120.0  # after the last fault, how long the job may take to end before it is cancelled


def checkpoint(
    deployment: LocalDeployment, cluster: str, owner: str, job_id: str, stage: str, step: int
) -> dict:
    path = deployment.run_dir / cluster / "trainer" / "accounts" / owner / "jobs" / job_id / stage
    return torch.load(path / f"step-{step}" / "model.pt", weights_only=True)


def compare_parameters(
    deployment: LocalDeployment, owners: dict[str, str], calm: str, stormy: str, step: int
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for cluster, stage in STAGES:
        try:
            ref = checkpoint(deployment, cluster, owners[cluster], calm, stage, step)
            got = checkpoint(deployment, cluster, owners[cluster], stormy, stage, step)
        except FileNotFoundError as exc:
            out[stage] = {"equal": False, "error": str(exc)}
            continue
        diffs = [float((ref[k].float() - got[k].float()).abs().max()) for k in ref if k in got]
        out[stage] = {
            "equal": ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref),
            "allclose_1e-5": ref.keys() == got.keys()
            and all(torch.allclose(got[k], ref[k], rtol=1e-5, atol=1e-6) for k in ref),
            "max_abs_diff": max(diffs, default=0.0),
            "tensors": len(ref),
        }
    return out


def compare_losses(calm: dict[int, float], stormy: dict[int, float]) -> dict[str, Any]:
    common = sorted(set(calm) & set(stormy))
    worst = max((abs(calm[s] - stormy[s]) / max(abs(calm[s]), 1e-6) for s in common), default=0.0)
    return {
        "steps_compared": len(common),
        "steps_missing_from_stormy": sorted(set(calm) - set(stormy)),
        "worst_relative_diff": worst,
        "equal_1e-5": worst <= 1e-5,
    }


def kill_and_restart(deployment: LocalDeployment, name: str) -> tuple[float, float, int, int]:
    """kill -9 ``name``; returns (kill time, time the supervisor reports it running again, old, new pid)."""
    process = deployment.process(name)
    old = process.pid
    assert old is not None
    at = time.monotonic()
    os.kill(old, signal.SIGKILL)
    wait_until(
        lambda: process.pid not in (None, old) and deployment.supervisor.status()[name]["state"] == "running",  # type: ignore[union-attr]
        120,
        f"{name} restarted",
        poll=0.05,
    )
    return at, time.monotonic(), old, process.pid  # type: ignore[return-value]


def run_faulted(
    deployment: LocalDeployment,
    sessions: dict[str, ClusterSession],
    spec: dict[str, Any],
    log: Any,
    cuts: tuple[float, float] = (10.0, 60.0),
    which: tuple[str, ...] = ("cut1", "cut2", "kill-a", "kill-b"),
) -> tuple[JobFollower, list[dict[str, Any]]]:
    handle = submit_job(numbers_job(**spec), sessions)
    follower = JobFollower(handle.job.job_id, handle.stages)
    wan = deployment.wan
    faults: list[dict[str, Any]] = []
    plan: list[tuple[str, Any]] = [
        (f"cut {cuts[0]:.0f} s", cuts[0]),
        (f"cut {cuts[1]:.0f} s", cuts[1]),
        ("kill -9 switch-a", "switch-a"),
        ("kill -9 switch-b", "switch-b"),
    ]
    plan = [p for p, key in zip(plan, ("cut1", "cut2", "kill-a", "kill-b"), strict=True) if key in which]
    next_at = GAP_STEPS
    for label, arg in plan:
        try:
            wait_until(
                lambda n=next_at: follower.done_steps("decoder") >= n or follower.final,
                300,
                f"step {next_at}",
                poll=0.02,
            )
        except TimeoutError:
            log(f"{label}: the job did not reach step {next_at}")
            break
        if follower.final:
            log(f"{label}: the job already ended: {follower.outcome()}")
            break
        step_at_fault = follower.done_steps("decoder")
        entry: dict[str, Any] = {"fault": label, "step_at_fault": step_at_fault}
        if isinstance(arg, float):
            start = time.monotonic()
            wan.cut()
            wan.reset_connections()
            time.sleep(arg)
            entry["steps_during"] = follower.done_steps("decoder") - step_at_fault
            wan.restore()
            end = time.monotonic()
        else:
            start, end, old, new = kill_and_restart(deployment, arg)
            entry.update(old_pid=old, new_pid=new)
        entry.update(start_s=round(start - follower.t0, 2), end_s=round(end - follower.t0, 2))
        entry["fault_duration_s"] = round(end - start, 2)
        try:
            link_up = wait_until(lambda: sessions["a"].link_status().connected, 180, "link up", poll=0.05)
            entry["link_up_after_s"] = round(time.monotonic() - end, 2) if link_up else None
        except TimeoutError:
            entry["link_up_after_s"] = None
        try:
            # Recovered = both stages completed a step after the fault's end: the decoder alone can finish
            # a step on replayed activations while the gradients back to the encoder are still stuck.
            step, t_dec = wait_until(
                lambda e=end: follower.first_step_after("decoder", e), RECOVERY_WAIT_S, "a decoder step"
            )
            entry.update(decoder_step_after_s=round(t_dec - end, 2))
            _, t_enc = wait_until(
                lambda e=end: follower.first_step_after("encoder", e), RECOVERY_WAIT_S, "an encoder step"
            )
            entry.update(recovery_s=round(max(t_dec, t_enc) - end, 2), recovered_at_step=step)
            next_at = step + GAP_STEPS
        except TimeoutError:
            entry.update(
                recovery_s=None,
                recovered_at_step=None,
                note=f"not both stages stepped within {RECOVERY_WAIT_S:.0f} s of the fault's end "
                f"(decoder at step {follower.done_steps('decoder')}, "
                f"encoder at {follower.done_steps('encoder')})",
            )
            log(f"{label}: no recovery: {follower.outcome()}")
            faults.append(entry)
            break
        log(f"{label}: {entry}")
        faults.append(entry)
    if not follower.wait(FINISH_TIMEOUT_S):
        log(f"the job did not end within {FINISH_TIMEOUT_S:.0f} s of the last fault: cancelled")
        follower.stalled_at_step = follower.done_steps("decoder")  # type: ignore[attr-defined]
        handle.cancel()
        follower.wait(60)
    return follower, faults


def reported_losses(follower: JobFollower) -> list[tuple[int, float]]:
    """Every (step, loss) the decoder reported, in order, steps re-run after a recovery included."""
    return [(e.steps_done, e.loss) for e in follower.events if e.stage == "decoder" and e.loss is not None]


def trainer_kill(
    deployment: LocalDeployment,
    sessions: dict[str, ClusterSession],
    spec: dict[str, Any],
    cluster: str,
    log: Any,
    owners: dict[str, str],
    calm: JobFollower,
) -> dict[str, Any]:
    """kill -9 one trainer mid-job (a job of its own): recovery time and exactly-once, as for the others.

    The supervisor restarts the trainer; it resumes its stage from its record at the next epoch, the
    peer stage follows, both restart from the last checkpoint both hold (steps after it are run
    again: "steps redone"). Recovery = from the supervisor reporting the trainer running again to
    the first step both stages complete past the step the job was at when killed. Lost / applied
    twice: this job's final parameters and every reported loss (re-run steps included) against the
    reference run.
    """
    name = f"trainer-{cluster}"
    handle = submit_job(numbers_job(**spec), sessions)
    follower = JobFollower(handle.job.job_id, handle.stages, give_up_s=TRAINER_KILL_WAIT_S + 60)
    # Past the first checkpoint, so the stages resume from a common checkpoint rather than step 0.
    kill_at = max(GAP_STEPS, int(spec.get("checkpoint__interval") or 0) + GAP_STEPS)
    wait_until(lambda: follower.done_steps("decoder") >= kill_at or follower.final, 300, f"step {kill_at}")
    step = follower.done_steps("decoder")
    start, end, old, new = kill_and_restart(deployment, name)
    entry: dict[str, Any] = {
        "fault": f"kill -9 {name}",
        "step_at_fault": step,
        "start_s": round(start - follower.t0, 2),
        "end_s": round(end - follower.t0, 2),
        "fault_duration_s": round(end - start, 2),
        "old_pid": old,
        "new_pid": new,
        "separate_job": handle.job.job_id,
    }
    try:
        past = [
            wait_until(lambda s=stage: follower.first_step_after(s, end), RECOVERY_WAIT_S, f"a {stage} step")
            for stage in ("decoder", "encoder")
        ]
        entry.update(
            recovery_s=round(max(t for _, t in past) - end, 2),
            recovered_at_step=past[0][0],
        )
    except TimeoutError:
        entry.update(
            recovery_s=None, recovered_at_step=None, note=f"no new step within {RECOVERY_WAIT_S:.0f} s"
        )
    ended = follower.wait(TRAINER_KILL_WAIT_S)
    if not ended:
        entry["note"] = f"not every stage ended within {TRAINER_KILL_WAIT_S:.0f} s of the kill; cancelled"
        handle.cancel()
        follower.wait(30)
    recovering = [e for e in follower.events if e.state == "recovering"]
    entry["recovering"] = [
        {"t": round(e.t - (start - follower.t0), 2), "stage": e.stage, "message": e.message}
        for e in recovering
    ]
    entry["resumed_from_step"] = min(
        (s.resumed_from_step for s in follower.final.values() if s.epoch > 0), default=None
    )
    entry["steps_redone"] = (
        step - entry["resumed_from_step"] if entry["resumed_from_step"] is not None else None
    )
    entry["outcome"] = follower.outcome()
    entry["watch_errors"] = [list(e) for e in follower.watch_errors[:3]]
    finished = {o["state"] for o in entry["outcome"].values()} == {"succeeded"}
    params = compare_parameters(deployment, owners, calm.job_id, follower.job_id, spec["steps"])
    reference = dict(reported_losses(calm))
    reports = reported_losses(follower)
    mismatched = sorted({s for s, loss in reports if reference.get(s) != loss})
    exact = finished and not mismatched and set(reference) <= {s for s, _ in reports}
    exact = exact and all(p.get("equal") for p in params.values())
    entry["exactly_once"] = {
        "parameters": params,
        "loss_reports": len(reports),
        "loss_steps_differing": mismatched,
        "finished": finished,
        "bit_identical": exact,
    }
    entry["lost_micro_batches"] = 0 if exact else None
    entry["applied_twice"] = 0 if exact else None
    log(f"{name}: {entry}")
    return entry


def render(path: Path, r: dict[str, Any]) -> None:
    """The PNG from a result: steps over time (faults shaded) above, RSS of switches and trainers below."""
    width, height = 1200, 560
    canvas = Canvas(width, height)
    timeline = r["step_timeline"]
    decoder = sorted((int(s), t) for s, t in timeline["faulted"].items())
    encoder = sorted((int(s), t) for s, t in timeline.get("faulted_encoder", {}).items())
    reference = sorted((int(s), t) for s, t in timeline["reference"].items())
    ended = [o["ended_at_s"] for o in r["faulted"]["outcome"].values()]
    t_end = max([t for _, t in decoder] + ended + [1.0])
    xr = (0.0, t_end * 1.02)
    top = Plot(canvas, (60, 20, width - 20, 330), xr, (0, r["job"]["steps"]))
    for fault in r["faults"]:
        colour = PALETTE["cut"] if fault["fault"].startswith("cut") else PALETTE["kill"]
        top.span(fault["start_s"], max(fault["end_s"], fault["start_s"] + 0.5), colour)
        recovery = fault.get("recovery_s")
        top.span(
            fault["end_s"], fault["end_s"] + (recovery if recovery is not None else t_end), PALETTE["gap"]
        )
    top.points([(t, s) for s, t in reference], PALETTE["grey"], r=1)
    top.points([(t, s) for s, t in decoder], PALETTE["blue"], r=2, join=True)
    top.points([(t, s) for s, t in encoder], PALETTE["green"], r=1)
    for t in ended:
        top.vline(t, PALETTE["red"])
    top.xticks(10.0)
    offset = r.get("sampler_offset_s", 0.0)
    names = ("switch-a", "switch-b", "trainer-a", "trainer-b")
    series = {n: [(x["t"] + offset, x["rss_kib"]) for x in r["samples"] if x["name"] == n] for n in names}
    peak = max((v for pts in series.values() for _, v in pts), default=1)
    bottom = Plot(canvas, (60, 360, width - 20, height - 20), xr, (0, peak * 1.05))
    for fault in r["faults"]:
        colour = PALETTE["cut"] if fault["fault"].startswith("cut") else PALETTE["kill"]
        bottom.span(fault["start_s"], max(fault["end_s"], fault["start_s"] + 0.5), colour)
    for name, colour in zip(names, ("red", "orange", "green", "purple"), strict=True):
        bottom.points([p for p in series[name] if p[0] <= xr[1]], PALETTE[colour], r=1, join=True)
    bottom.xticks(10.0)
    canvas.save(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--checkpoint-interval",
        type=int,
        default=8,
        help="steps between checkpoints (a killed trainer's "
        "stage resumes from the last one both stages hold)",
    )
    parser.add_argument("--skip-trainer-kills", action="store_true")
    parser.add_argument("--faults", default="cut1,cut2,kill-a,kill-b", help="which faults, in this order")
    parser.add_argument("--quick", action="store_true", help="smoke run: cuts of 3 s and 6 s")
    parser.add_argument("--render", type=Path, help="only redraw the PNG and markdown from this JSON result")
    args = parser.parse_args()
    if args.render:
        result = json.loads(args.render.read_text())
        render(args.render.with_suffix(".png"), result)
        args.render.with_suffix(".md").write_text(report(result))
        return
    run_dir = args.out / "run-timeline"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    started = time.time()
    lines: list[str] = []

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        lines.append(line)

    spec = {
        "steps": args.steps,
        "data__batch_size": args.batch_size,
        "checkpoint__interval": args.checkpoint_interval,
    }
    load_before = load_info()
    with LocalDeployment(run_dir=run_dir, bandwidth_mbit=BANDWIDTH_MBIT, delay_ms=DELAY_MS) as deployment:
        sessions = {"a": make_user(deployment, "a", "alice"), "b": make_user(deployment, "b", "bob")}
        owners = {"a": "alice", "b": "bob"}
        calm_handle = submit_job(numbers_job(**spec), sessions)
        calm = JobFollower(calm_handle.job.job_id, calm_handle.stages)
        calm.wait(900)
        log(f"reference run: {calm.outcome()} mean step {calm.mean_step_seconds('decoder')}")
        sampler = ProcessSampler(deployment, ["switch-a", "switch-b", "trainer-a", "trainer-b"], 0.5)
        sampler.t0 = time.monotonic()
        sampler.start()
        stormy, faults = run_faulted(
            deployment,
            sessions,
            spec,
            log,
            (3.0, 6.0) if args.quick else (10.0, 60.0),
            tuple(args.faults.split(",")),
        )
        samples = sampler.stop()
        log(f"faulted run: {stormy.outcome()}")
        params = compare_parameters(deployment, owners, calm.job_id, stormy.job_id, args.steps)
        losses = compare_losses(calm.losses, stormy.losses)
        exact = (
            all(p.get("equal") or p.get("allclose_1e-5") for p in params.values()) and losses["equal_1e-5"]
        )
        finished = {o["state"] for o in stormy.outcome().values()} == {"succeeded"}
        for fault in faults:
            # The whole job's parameters are checked once, at the end, for all four faults together.
            fault["lost_micro_batches"] = 0 if exact and finished else None
            fault["applied_twice"] = 0 if exact and finished else None
        retry: dict[str, Any] | None = None
        if not finished and "kill-b" in args.faults:
            # The job did not finish: measure exactly-once for the other faults in a job without kill-b.
            log("the faulted job did not finish: again without the switch-b kill, to measure exactly-once")
            again, again_faults = run_faulted(
                deployment,
                sessions,
                spec,
                log,
                (3.0, 6.0) if args.quick else (10.0, 60.0),
                tuple(f for f in args.faults.split(",") if f != "kill-b"),
            )
            again_params = compare_parameters(deployment, owners, calm.job_id, again.job_id, args.steps)
            again_losses = compare_losses(calm.losses, again.losses)
            again_finished = {o["state"] for o in again.outcome().values()} == {"succeeded"}
            again_exact = again_finished and again_losses["equal_1e-5"]
            again_exact = again_exact and all(
                p.get("equal") or p.get("allclose_1e-5") for p in again_params.values()
            )
            for fault in again_faults:
                fault["lost_micro_batches"] = 0 if again_exact else None
                fault["applied_twice"] = 0 if again_exact else None
            retry = {
                "faults": again_faults,
                "outcome": again.outcome(),
                "exactly_once": {
                    "parameters": again_params,
                    "losses": again_losses,
                    "finished": again_finished,
                    "exact": again_exact,
                },
                "step_timeline": {
                    str(k): round(t - again.t0, 3) for k, t in sorted(again.steps["decoder"].items())
                },
            }
        trainer_kills = []
        if not args.skip_trainer_kills:
            for cluster in ("a", "b"):
                trainer_kills.append(trainer_kill(deployment, sessions, spec, cluster, log, owners, calm))
        supervisor_events = deployment.supervisor.status() if deployment.supervisor else {}
    load_after = load_info()
    result = {
        "benchmark": "faults-timeline",
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wan": {"bandwidth_mbit": BANDWIDTH_MBIT, "delay_ms": DELAY_MS},
        "job": {"builtin": "numbers", **spec, "codec": "none"},
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": load_after,
        "reference": {
            "outcome": calm.outcome(),
            "mean_step_s": calm.mean_step_seconds("decoder"),
            "duration_s": round(max(calm.final_at.values()) - calm.t0, 2) if calm.final_at else None,
        },
        "faulted": {
            "outcome": stormy.outcome(),
            "mean_step_s_outside_faults": None,
            "duration_s": round(max(stormy.final_at.values()) - stormy.t0, 2) if stormy.final_at else None,
            "watch_errors": [list(e) for e in stormy.watch_errors],
        },
        "faults": faults,
        "exactly_once": {"parameters": params, "losses": losses, "finished": finished, "exact": exact},
        "stalled_at_step": getattr(stormy, "stalled_at_step", None),
        "without_switch_b_kill": retry,
        "trainer_kills": trainer_kills,
        "supervisor": supervisor_events,
        "step_timeline": {
            "reference": {str(s): round(t - calm.t0, 3) for s, t in sorted(calm.steps["decoder"].items())},
            "faulted": {str(s): round(t - stormy.t0, 3) for s, t in sorted(stormy.steps["decoder"].items())},
            "faulted_encoder": {
                str(s): round(t - stormy.t0, 3) for s, t in sorted(stormy.steps["encoder"].items())
            },
        },
        "samples": samples,
        "sampler_offset_s": round(sampler.t0 - stormy.t0, 3),
        "log": lines,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "faults-timeline.json", result)
    render(args.out / "faults-timeline.png", result)
    (args.out / "faults-timeline.md").write_text(report(result))
    print(report(result))


def report(r: dict[str, Any]) -> str:
    ex = r["exactly_once"]
    rows = [
        [
            f["fault"],
            f["step_at_fault"],
            f["fault_duration_s"],
            f.get("link_up_after_s"),
            f.get("decoder_step_after_s"),
            f.get("recovery_s"),
            f.get("recovered_at_step"),
            f.get("lost_micro_batches"),
            f.get("applied_twice"),
        ]
        for f in r["faults"]
    ]
    out = [
        "# Fault timeline of one job",
        "",
        f"Built-in `numbers` job, {r['job']['steps']} steps, batch {r['job']['data__batch_size']}, "
        f"checkpoint every {r['job'].get('checkpoint__interval') or 'end only'} steps, "
        "codec none; "
        f"WAN {r['wan']['bandwidth_mbit']:.0f} Mbit/s, {r['wan']['delay_ms']:.0f} ms one-way; "
        f"{r['cpus']} CPUs shared with other engineers' work "
        f"(load average before {r['load_before']['loadavg_1m']}/{r['load_before']['loadavg_5m']}, "
        f"after {r['load_after']['loadavg_1m']}/{r['load_after']['loadavg_5m']} (1/5 min)). "
        f"Run {r['started_utc']}. Produced by `bench/faults/timeline.py` (`make bench-faults`).",
        "",
        f"Reference (undisturbed) run: {r['reference']['outcome']}, "
        f"mean step {fmt(r['reference']['mean_step_s'])} s, "
        f"{r['reference']['duration_s']} s in all. Faulted run: {r['faulted']['outcome']}, "
        f"{r['faulted']['duration_s']} s in all.",
        "",
        "Recovery = from the fault's end (restore; the supervisor reporting the killed switch running again) "
        "to the next step both stages complete (decoder and encoder). Link up = from the fault's end "
        "until switch a reports the link connected. Lost / applied twice: measured together for the "
        "whole faulted run by comparing both stages' final parameters and every per-step loss with the "
        "reference run (identical => 0 and 0).",
        "",
        md_table(
            [
                "fault",
                "at step",
                "fault s",
                "link up after s",
                "decoder step after s",
                "recovery s (both stages)",
                "next step",
                "micro-batches lost",
                "applied twice",
            ],
            rows,
        ),
        "",
        "Exactly-once check: "
        + ", ".join(
            f"{stage}: parameters {verdict(p)} (max |diff| {p.get('max_abs_diff', 'n/a')})"
            for stage, p in ex["parameters"].items()
        )
        + f"; per-step losses: {ex['losses']['steps_compared']} steps compared, worst relative difference "
        f"{ex['losses']['worst_relative_diff']:.2e}, "
        f"missing steps {ex['losses']['steps_missing_from_stormy'] or 'none'}.",
        "",
        *retry_lines(r),
        "![timeline](faults-timeline.png)",
        "",
        "Figure (no text in the PNG: rendered without matplotlib, which is not a dependency): top, completed "
        "decoder steps (y) against seconds since submission (x, ticks every 10 s); blue = faulted run "
        "(green dots: its encoder), "
        "grey = reference run; pink spans = WAN cuts, light-blue spans = switch kill until the supervisor "
        "reported it running, yellow = recovery (fault end to the next step of both stages; to the end "
        "when there was none), red lines = the stages' end. Bottom, RSS over the same time: "
        "red switch-a, orange switch-b, green trainer-a, purple trainer-b.",
        "",
    ]
    if r["trainer_kills"]:
        rows = [
            [
                k["fault"],
                k["step_at_fault"],
                k["fault_duration_s"],
                k.get("resumed_from_step"),
                k.get("steps_redone"),
                k.get("recovery_s"),
                k.get("recovered_at_step"),
                k.get("lost_micro_batches"),
                k.get("applied_twice"),
                ", ".join(f"{stage}: {o['state']}" for stage, o in k["outcome"].items()),
            ]
            for k in r["trainer_kills"]
        ]
        out += [
            "## `kill -9` of a trainer",
            "",
            "Each in a job of its own (same spec). The supervisor restarts the trainer (fault s = kill to "
            "the supervisor reporting it running); it resumes its stage from its on-disk record at the "
            "next epoch, the peer stage follows, and both restart from the last checkpoint both hold "
            "(resumed from; the steps after it are run again: steps redone). Recovery = from the restart "
            "to the first step both stages complete past the step the job was at. Lost / applied twice: "
            "the job's final parameters of both stages and every reported loss, re-run steps included, "
            "bit-identical to the reference run => 0 and 0.",
            "",
            md_table(
                [
                    "fault",
                    "at step",
                    "fault s",
                    "resumed from",
                    "steps redone",
                    "recovery s (both stages)",
                    "next step",
                    "micro-batches lost",
                    "applied twice",
                    "outcome",
                ],
                rows,
            ),
            "",
        ]
        for k in r["trainer_kills"]:
            ex = k["exactly_once"]
            out.append(
                f"- **{k['fault']}**: parameters "
                + ", ".join(f"{stage}: {verdict(p)}" for stage, p in ex["parameters"].items())
                + f"; {ex['loss_reports']} loss reports, "
                + f"differing steps: {ex['loss_steps_differing'] or 'none'}"
                + (f"; first RECOVERING: `{k['recovering'][0]['message']}`" if k["recovering"] else "")
                + (f"; {k['note']}" if k.get("note") else "")
            )
        out.append("")
    return "\n".join(out)


def retry_lines(r: dict[str, Any]) -> list[str]:
    lines = []
    if r.get("stalled_at_step") is not None:
        lines += [
            f"**The faulted job did not finish**: it stalled at step {r['stalled_at_step']} and was "
            "cancelled "
            f"{FINISH_TIMEOUT_S:.0f} s after the last fault (see the bug note in the closing section).",
            "",
        ]
    again = r.get("without_switch_b_kill")
    if again:
        ex = again["exactly_once"]
        rows = [
            [
                f["fault"],
                f["step_at_fault"],
                f["fault_duration_s"],
                f.get("link_up_after_s"),
                f.get("recovery_s"),
                f.get("lost_micro_batches"),
                f.get("applied_twice"),
            ]
            for f in again["faults"]
        ]
        lines += [
            "Same job again without the switch-b kill (to measure exactly-once for the other faults): "
            f"outcome {again['outcome']}; parameters: "
            + ", ".join(f"{stage}: {verdict(p)}" for stage, p in ex["parameters"].items())
            + f"; losses: {ex['losses']['steps_compared']} steps compared, worst relative difference "
            f"{ex['losses']['worst_relative_diff']:.2e}.",
            "",
            md_table(
                ["fault", "at step", "fault s", "link up after s", "recovery s", "lost", "applied twice"],
                rows,
            ),
            "",
        ]
    return lines


def verdict(p: dict[str, Any]) -> str:
    if p.get("equal"):
        return "identical"
    return "within 1e-5" if p.get("allclose_1e-5") else "DIFFER"


def fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


if __name__ == "__main__":
    main()
