"""Soak: jobs starting and ending continuously under random WAN cuts and switch/trainer kills; no growth.

One two-cluster deployment (``LocalDeployment``, supervised). For ``SOAK_SECONDS`` (default 600):

* a job launcher keeps ``--concurrency`` (3) small ``numbers`` jobs running (a new one as soon as one
  ends), each under one of four accounts; a job still running ``--job-deadline`` (360) s after its
  submission is cancelled and counted as *stuck* (no clear reason: it fails the verdict);
* a fault injector waits a random 15-40 s, then either cuts the WAN for a random 5-20 s
  (``cut()`` + ``reset_connections()``, then ``restore()``) or ``kill -9``s switch a, switch b, trainer a
  or trainer b (the supervisor restarts it; a restarted trainer resumes its stages from the last common
  checkpoint, and the job's watchers re-attach);
* every 2 s, RSS, thread count and open fds of both switches and both trainers (from /proc).

Verdict: no growth, comparing the first quarter of each process's samples with the last quarter (of its
longest-lived pid, so a restart neither hides nor fakes growth, without its first 15 s of start-up): RSS
by median, threads and fds by maximum (they rise and fall with the stages in flight; with 3 jobs in
flight almost all the time the ceiling is the comparable state, and a leak raises it): RSS may
grow by at most max(10%, 32 MiB), threads by at most 4, fds by at most 8
(tolerances for allocator noise, gRPC's thread pools and the job in flight at sampling time); and every
job either succeeded or failed with a non-empty reason.

Usage: ``SOAK_SECONDS=180 python bench/faults/soak.py [--out DIR]``; writes soak.json and soak.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import JobFollower, ProcessSampler, load_info, md_table, wait_until, write_json

from nebula_common.launcher import LocalDeployment
from nebula_common.sdk.client import submit_job
from tests.support.accounts import make_user
from tests.support.jobs import numbers_job

BANDWIDTH_MBIT, DELAY_MS = 60.0, 20.0
ACCOUNTS = ("soak0", "soak1", "soak2", "soak3")
WATCHED = ("switch-a", "switch-b", "trainer-a", "trainer-b")
RSS_TOLERANCE = (0.10, 32 * 1024)  # fraction, KiB: the larger of the two
THREADS_TOLERANCE, FDS_TOLERANCE = 4, 8
WARMUP_S = 15.0  # samples of a pid's first seconds are left out of its growth verdict


def growth_verdict(samples: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in WATCHED:
        named = [r for r in samples if r["name"] == name]
        pids = sorted({r["pid"] for r in named})
        # The longest-lived incarnation: a killed process restarts small, which would hide growth.
        longest = max(pids, key=lambda pid: sum(1 for r in named if r["pid"] == pid), default=None)
        rows = [r for r in named if r["pid"] == longest]
        # A restarted process's first seconds are its start-up (imports, 2 threads): not a baseline.
        if rows:
            rows = [r for r in rows if r["t"] >= rows[0]["t"] + WARMUP_S]
        if len(rows) < 8:
            out[name] = {"ok": None, "note": "too few samples"}
            continue
        quarter = max(1, len(rows) // 4)
        first, last = rows[:quarter], rows[-quarter:]
        entry: dict[str, Any] = {"pids": pids, "measured_pid": longest, "samples": len(rows)}
        ok = True
        for key in ("rss_kib", "threads", "fds"):
            if key == "rss_kib":
                a = statistics.median(r[key] for r in first)
                b = statistics.median(r[key] for r in last)
            else:
                # Threads and fds rise and fall with the stages in flight (each adds its own): the soak
                # keeps 3 jobs in flight almost all the time, so the ceiling is the comparable state
                # (the floor is whatever moment fell between two jobs); a leak raises the ceiling.
                a = max(r[key] for r in first)
                b = max(r[key] for r in last)
            if key == "rss_kib":
                allowed = max(a * RSS_TOLERANCE[0], RSS_TOLERANCE[1])
            else:
                allowed = THREADS_TOLERANCE if key == "threads" else FDS_TOLERANCE
            grew = b - a > allowed
            ok = ok and not grew
            entry[key] = {
                "first_quarter": a,
                "last_quarter": b,
                "max": max(r[key] for r in rows),
                "floor": [min(r[key] for r in first), min(r[key] for r in last)],
                "allowed_growth": allowed,
                "grew": grew,
            }
        entry["ok"] = ok
        out[name] = entry
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--seconds", type=float, default=float(os.environ.get("SOAK_SECONDS", "600")))
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--job-deadline", type=float, default=360.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--render", type=Path, help="only rewrite the markdown from this JSON result")
    args = parser.parse_args()
    if args.render:  # the growth verdict is recomputed from the recorded samples (same data, same rule)
        result = json.loads(args.render.read_text())
        result["growth"] = growth_verdict(result["samples"])
        result["verdict"]["no_growth"] = all(g.get("ok") for g in result["growth"].values())
        result["verdict"]["pass"] = (
            result["verdict"]["no_growth"] and result["verdict"]["every_job_finished_or_failed_with_reason"]
        )
        write_json(args.render, result)
        args.render.with_suffix(".md").write_text(report(result))
        return
    rng = random.Random(args.seed)
    run_dir = args.out / "run-soak"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    started = time.time()
    log_lines: list[str] = []
    lock = threading.Lock()

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        with lock:
            log_lines.append(line)

    load_before = load_info()
    with LocalDeployment(run_dir=run_dir, bandwidth_mbit=BANDWIDTH_MBIT, delay_ms=DELAY_MS) as deployment:
        users = {u: {c: make_user(deployment, c, u) for c in ("a", "b")} for u in ACCOUNTS}
        sampler = ProcessSampler(deployment, list(WATCHED), 2.0).start()
        t0 = time.monotonic()
        end = t0 + args.seconds
        stop = threading.Event()
        jobs: list[dict[str, Any]] = []
        faults: list[dict[str, Any]] = []

        def run_one(index: int) -> None:
            owner = ACCOUNTS[index % len(ACCOUNTS)]
            steps = rng.choice((12, 20, 30))
            entry: dict[str, Any] = {"index": index, "owner": owner, "steps": steps, "submitted_s": None}
            with lock:
                jobs.append(entry)
            entry["submitted_s"] = round(time.monotonic() - t0, 1)
            try:
                handle = submit_job(numbers_job(steps=steps, data__batch_size=16), users[owner])
            except Exception as exc:
                entry.update(state="submit failed", reason=f"{type(exc).__name__}: {exc}")
                log(f"job {index}: submit failed: {exc}")
                return
            entry["job_id"] = handle.job.job_id
            follower = JobFollower(handle.job.job_id, handle.stages, give_up_s=args.job_deadline + 120)
            if not follower.wait(args.job_deadline):
                try:
                    handle.cancel()
                except Exception as exc:
                    entry["cancel_error"] = str(exc)
                follower.wait(60)
                entry["stuck"] = True
                entry["steps_done_at_deadline"] = follower.done_steps("decoder")
            outcome = follower.outcome()
            states = {o["state"] for o in outcome.values()}
            entry["stages"] = outcome
            entry["ended_s"] = round(time.monotonic() - t0, 1)
            entry["state"] = (
                "stuck (cancelled by the soak)"
                if entry.get("stuck")
                else "succeeded"
                if states == {"succeeded"}
                else "/".join(sorted(states)) or "unknown"
            )
            entry["reason"] = "; ".join(
                sorted({o["message"][:300] for o in outcome.values() if o["message"]})
            )
            log(f"job {index} ({handle.job.job_id}): {entry['state']} {entry['reason'][:200]}")

        def launcher() -> None:
            index = 0
            running: list[threading.Thread] = []
            while time.monotonic() < end and not stop.is_set():
                running = [t for t in running if t.is_alive()]
                while len(running) < args.concurrency:
                    thread = threading.Thread(target=run_one, args=(index,), daemon=True)
                    thread.start()
                    running.append(thread)
                    index += 1
                time.sleep(0.5)
            for thread in running:
                thread.join(args.job_deadline + 90)

        def injector() -> None:
            wan = deployment.wan
            while not stop.is_set():
                if stop.wait(rng.uniform(15, 40)) or time.monotonic() > end - 10:
                    return
                kind = rng.choice(
                    ("cut", "cut", "kill switch-a", "kill switch-b", "kill trainer-a", "kill trainer-b")
                )
                at = round(time.monotonic() - t0, 1)
                entry: dict[str, Any] = {"fault": kind, "at_s": at}
                try:
                    if kind == "cut":
                        seconds = round(rng.uniform(5, 20), 1)
                        entry["fault"] = f"cut {seconds} s"
                        wan.cut()
                        wan.reset_connections()
                        time.sleep(seconds)
                        wan.restore()
                    else:
                        name = kind.split()[1]
                        process = deployment.process(name)
                        old = process.pid
                        os.kill(old, signal.SIGKILL)  # type: ignore[arg-type]
                        wait_until(
                            lambda p=process, o=old, n=name: (
                                p.pid not in (None, o)
                                and deployment.supervisor.status()[n]["state"] == "running"
                            ),  # type: ignore[union-attr]
                            120,
                            f"{name} restarted",
                        )
                        entry["restarted_after_s"] = round(time.monotonic() - t0 - at, 2)
                except Exception as exc:
                    entry["error"] = f"{type(exc).__name__}: {exc}"
                faults.append(entry)
                log(f"fault: {entry}")

        threads = [
            threading.Thread(target=launcher, daemon=True),
            threading.Thread(target=injector, daemon=True),
        ]
        for thread in threads:
            thread.start()
        threads[1].join(args.seconds + 60)
        threads[0].join(args.seconds + args.job_deadline + 200)
        stop.set()
        time.sleep(6.0)  # a few idle samples at the end
        samples = sampler.stop()
        supervisor = deployment.supervisor.status() if deployment.supervisor else {}
    load_after = load_info()
    growth = growth_verdict(samples)
    clear = [
        j for j in jobs if j.get("state") == "succeeded" or (j.get("state") == "failed" and j.get("reason"))
    ]
    verdict_jobs = len(clear) == len(jobs)
    verdict_growth = all(g.get("ok") for g in growth.values())
    result = {
        "benchmark": "soak",
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "seconds": args.seconds,
        "wan": {"bandwidth_mbit": BANDWIDTH_MBIT, "delay_ms": DELAY_MS},
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": load_after,
        "concurrency": args.concurrency,
        "job_deadline_s": args.job_deadline,
        "seed": args.seed,
        "jobs": jobs,
        "faults": faults,
        "growth": growth,
        "tolerances": {
            "rss": "max(10%, 32 MiB)",
            "threads": THREADS_TOLERANCE,
            "fds": FDS_TOLERANCE,
        },
        "verdict": {
            "no_growth": verdict_growth,
            "every_job_finished_or_failed_with_reason": verdict_jobs,
            "pass": verdict_growth and verdict_jobs,
        },
        "supervisor": supervisor,
        "samples": samples,
        "log": log_lines,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "soak.json", result)
    (args.out / "soak.md").write_text(report(result))
    print(report(result))


def rss_per_job(r: dict[str, Any]) -> list[str]:
    """How much each never-restarted process grew per job, first sample to last."""
    lines = []
    jobs = max(1, len(r["jobs"]))
    for name in ("trainer-a", "trainer-b"):
        rows = [x for x in r["samples"] if x["name"] == name]
        if len({x["pid"] for x in rows}) != 1 or len(rows) < 2:
            continue
        grown = (rows[-1]["rss_kib"] - rows[0]["rss_kib"]) / 1024
        lines.append(
            f"- {name}: RSS {rows[0]['rss_kib'] / 1024:.0f} -> {rows[-1]['rss_kib'] / 1024:.0f} MiB over "
            f"{len(r['jobs'])} jobs ({grown / jobs:.1f} MiB per job), not returned while idle at the end."
        )
    return [*lines, ""] if lines else []


def report(r: dict[str, Any]) -> str:
    counts: dict[str, int] = {}
    for job in r["jobs"]:
        counts[job.get("state", "unknown")] = counts.get(job.get("state", "unknown"), 0) + 1
    reasons: dict[str, int] = {}
    for job in r["jobs"]:
        if job.get("state") != "succeeded":
            reason = " ".join((job.get("reason") or "(no reason)").split())  # gRPC errors span lines
            key = f"{job.get('state')}: {reason}"[:240]
            reasons[key] = reasons.get(key, 0) + 1
    growth_rows = []
    for name, g in r["growth"].items():
        if g.get("ok") is None:
            growth_rows.append([name, "n/a", "n/a", "n/a", "n/a"])
            continue
        growth_rows.append(
            [
                name,
                f"{g['rss_kib']['first_quarter'] / 1024:.0f} -> "
                f"{g['rss_kib']['last_quarter'] / 1024:.0f} (max {g['rss_kib']['max'] / 1024:.0f})",
                f"{g['threads']['first_quarter']:.0f} -> {g['threads']['last_quarter']:.0f}",
                f"{g['fds']['first_quarter']:.0f} -> {g['fds']['last_quarter']:.0f}",
                ("ok" if g["ok"] else "GREW") + f" ({len(g['pids'])} pid(s))",
            ]
        )
    v = r["verdict"]
    return "\n".join(
        [
            "# Soak: jobs under random WAN cuts and switch and trainer kills",
            "",
            f"{r['seconds']:.0f} s, seed {r['seed']}; {r['concurrency']} `numbers` jobs at a time (deadline "
            f"{r['job_deadline_s']:.0f} s) (batch 16, "
            f"12/20/30 steps), 4 accounts; a fault every 15-40 s: WAN cut of 5-20 s (with every connection "
            "reset) or `kill -9` of switch a or b or trainer a or b. "
            f"WAN {r['wan']['bandwidth_mbit']:.0f} Mbit/s, "
            f"{r['wan']['delay_ms']:.0f} ms; {r['cpus']} CPUs shared with other engineers (load average "
            f"before {r['load_before']['loadavg_1m']}, after {r['load_after']['loadavg_1m']}). "
            f"Run {r['started_utc']}; "
            "`bench/faults/soak.py` (`make soak`).",
            "",
            f"**Verdict: {'PASS' if v['pass'] else 'FAIL'}** - no growth: {v['no_growth']}; "
            "every job finished or failed with a clear reason: "
            f"{v['every_job_finished_or_failed_with_reason']}.",
            "",
            f"Jobs: {len(r['jobs'])} - " + ", ".join(f"{k}: {n}" for k, n in sorted(counts.items())) + ".",
            "",
            *(f"- {n} x {k}" for k, n in sorted(reasons.items())),
            "",
            f"Faults: {len(r['faults'])} - " + ", ".join(f["fault"] for f in r["faults"]) + ".",
            "",
            "Growth (first quarter of samples -> last quarter of each process's longest-lived pid; RSS "
            "by median, threads and fds by maximum, since they rise and fall with the stages in flight; "
            f"tolerances: RSS {r['tolerances']['rss']}, threads +{r['tolerances']['threads']}, "
            f"fds +{r['tolerances']['fds']}):",
            "",
            md_table(["process", "RSS MiB", "threads", "fds", "verdict"], growth_rows),
            "",
            *rss_per_job(r),
        ]
    )


if __name__ == "__main__":
    main()
