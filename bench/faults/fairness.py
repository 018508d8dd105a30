"""16 concurrent jobs of 4 accounts through one switch pair, one slow receiver and one flooder.

Phases, on one two-cluster deployment (``LocalDeployment``):

1. **alone**: one healthy job alone, then the slow-receiver job alone (each one's step time alone);
2. **healthy mix**: the 15 healthy jobs together (what 15 jobs cost each other on this machine's CPUs:
   the trainers compute every job on the same 2 cores, which no switch can hide);
3. **slow mix**: the same 15 healthy jobs + the slow receiver (``examples/slow_receiver``: its downstream
   stage sleeps in every micro-batch);
4. **full mix**: the slow mix + a flooder: a raw ``Relay.OpenEdge`` client of a fifth account on switch
   a, opening an edge whose peer never attaches and sending header-only frames as fast as gRPC takes
   them (re-opening under a new job id each time it is closed or refused).

Phases 3 and 4 run ``--rounds`` times in turn (slow, full, slow, full, ...): the machine is shared, so
the flooder's cost is read side by side, as the ratio of each full mix to the slow mix just before it,
with the load average at the start and end of every phase.

Healthy jobs: ``examples/digit_sum`` (accounts user0..user3, four jobs each less one: 15). Per job: mean step
time (steps after the second); throughput = 1 / mean step time; Jain's fairness index over the healthy
jobs' throughput in each mix. Switch RSS, threads and open fds sampled every 0.5 s from /proc.

Usage: ``python bench/faults/fairness.py [--out DIR] [--steps N] [--rounds N]``; writes
faults-fairness.json/.md/.png.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    PALETTE,
    Canvas,
    JobFollower,
    Plot,
    ProcessSampler,
    jain,
    load_info,
    md_table,
    write_json,
)

from bench.wan.utilisation import switch_connections
from nebula_common.errors import NebulaError
from nebula_common.jobspec import load_spec
from nebula_common.launcher import LocalDeployment
from nebula_common.pki.service_identity import ServiceTlsFiles, service_tls_dir
from nebula_common.proto.nebula.v1 import relay_pb2, relay_pb2_grpc, tensor_pb2
from nebula_common.rpc import bearer_metadata
from nebula_common.rpc.framing import LINK_FRAMING_VERSION
from nebula_common.rpc.internal_tls import ClientTls, internal_channel
from nebula_common.sdk.client import ClusterSession, submit_job
from nebula_common.sdk.jobs import ProgramJob
from services.switch.config import SwitchSettings
from services.switch.route_limits import INITIAL_WINDOW_BYTES, SLACK_BYTES, Limits
from tests.support.accounts import make_user

ROOT = Path(__file__).resolve().parents[2]
HEALTHY_SPEC = ROOT / "examples" / "digit_sum" / "job.yaml"
SLOW_SPEC = ROOT / "examples" / "slow_receiver" / "job.yaml"
BANDWIDTH_MBIT, DELAY_MS = 60.0, 20.0
SLOW_SLEEP_S = 0.5  # examples/slow_receiver/job.yaml, head stage option sleep_s
SLOW_ALONE_STEPS = 6  # 4 micro-batches x 0.5 s: about 2 s a step
SLOW_MIX_STEPS = 10_000  # runs for the whole mix; cancelled when the healthy jobs are done
SUBMIT_FAILURES: list[dict[str, str]] = []
FLOODER_NICE = 19
ACCOUNTS = ("user0", "user1", "user2", "user3")
# Stated bound (docs/data-plane.md, "Memory bound"): max_attached_routes x 2 x (2W + S) +
# max_unattached_routes x (1 MiB + S) of buffered items per switch with the defaults (about 8.3 GiB).
W = SwitchSettings.model_fields["max_window_bytes"].default
S = SLACK_BYTES
STATED_BOUND_BYTES = Limits.max_attached_routes * 2 * (2 * W + S) + Limits.max_unattached_routes * (
    INITIAL_WINDOW_BYTES + S
)


class Flooder:
    """A raw Relay client of its own account: header-only frames on an edge nobody attaches, flat out."""

    def __init__(
        self, address: str, token: str, rate: float = 0.0, prefix: str = "flood", tls: ClientTls | None = None
    ) -> None:
        self.address, self.token, self.rate, self.prefix = address, token, rate, prefix
        self.tls = tls  # a trainer's identity: only trainers may open edges (internal TLS)
        self.closes: list[dict[str, Any]] = []
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = time.monotonic()

    def start(self) -> Flooder:
        self._thread.start()
        return self

    def _frames(self, job_id: str, stop: threading.Event) -> Iterator[relay_pb2.EdgeMessage]:
        yield relay_pb2.EdgeMessage(
            open=relay_pb2.EdgeOpen(job_id=job_id, edge="e", link_framing=LINK_FRAMING_VERSION)
        )
        for frame_id in itertools.count(1):
            if stop.is_set() or self._stop.is_set():
                return
            self.sent += 1
            if self.rate and frame_id % 100 == 0:
                time.sleep(100 / self.rate)
            yield relay_pb2.EdgeMessage(
                frame=tensor_pb2.TensorFrame(header=tensor_pb2.TensorHeader(frame_id=frame_id, codec="none"))
            )

    def _run(self) -> None:
        for attempt in itertools.count(1):
            if self._stop.is_set():
                return
            job_id = f"{self.prefix}-{attempt}"
            stop = threading.Event()
            opened = time.monotonic()
            sent_before = self.sent
            entry: dict[str, Any] = {"job_id": job_id, "opened_at_s": round(opened - self.t0, 2)}
            with internal_channel(self.address, service="switch", tls=self.tls) as channel:
                call = relay_pb2_grpc.RelayStub(channel).OpenEdge(
                    self._frames(job_id, stop), metadata=bearer_metadata(self.token)
                )
                try:
                    for message in call:
                        kind = message.WhichOneof("body")
                        if kind == "close":
                            entry.update(
                                closed_after_s=round(time.monotonic() - opened, 3),
                                reason=message.close.reason,
                                error=bool(getattr(message.close, "error", False)),
                            )
                            break
                        if self._stop.is_set():
                            break
                except grpc.RpcError as exc:
                    entry.update(
                        closed_after_s=round(time.monotonic() - opened, 3),
                        rpc_error=f"{exc.code().name}: {exc.details()}",
                    )
                stop.set()
                call.cancel()
            entry["frames_sent"] = self.sent - sent_before
            if "closed_after_s" in entry or "rpc_error" in entry:
                self.closes.append(entry)
            if self._stop.is_set():
                return
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def flood_process(
    address: str, token: str, result: Path, rate: float, prefix: str = "flood", tls_dir: Path | None = None
) -> None:
    """The flooder as a process of its own, until SIGTERM.

    At the lowest CPU priority (nice 19): on one 2-CPU host the flooder's own frame-making (0.8 cores
    flat out) otherwise takes the CPU of the trainers beside it, which a real flooder, whose process
    runs on its own host in another network, cannot do. What the switch spends on its frames is still
    the benchmark's: nice changes who gets the CPU under contention, not how many frames reach the
    switch (it needs a fraction of a core to exceed the switch's per-account item rate).
    """
    os.nice(FLOODER_NICE)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    tls = ClientTls.for_service(ServiceTlsFiles.in_dir(tls_dir), "a") if tls_dir else None
    flooder = Flooder(address, token, rate, prefix, tls).start()
    done.wait()
    flooder.stop()
    times = os.times()
    write_json(
        result,
        {
            "frames_sent": flooder.sent,
            "closes": flooder.closes,
            "cpu_s": round(times.user + times.system, 2),
            "seconds": round(time.monotonic() - flooder.t0, 2),
        },
    )


def healthy_job(owner_index: int, job_index: int, steps: int) -> ProgramJob:
    loaded = load_spec(HEALTHY_SPEC, {"steps": steps, "checkpoint.interval": steps})
    return ProgramJob(loaded, f"healthy-{owner_index}-{job_index}-{int(time.time() * 1000) % 10**8}")


def slow_job(steps: int = SLOW_ALONE_STEPS) -> ProgramJob:
    loaded = load_spec(SLOW_SPEC, {"steps": steps})
    return ProgramJob(loaded, f"slow-{int(time.time() * 1000) % 10**8}")


def run_jobs(
    jobs: list[tuple[str, ProgramJob, dict[str, ClusterSession]]],
    timeout: float,
    background: tuple[str, ...] = (),
) -> dict[str, JobFollower]:
    """Submit every job at once (in parallel), wait for them; ``background`` jobs are cancelled after.

    A submission that fails is recorded in ``SUBMIT_FAILURES`` (label, reason) and left out.
    """
    followers: dict[str, JobFollower] = {}
    handles = {}

    def submit(item: tuple[str, ProgramJob, dict[str, ClusterSession]]) -> None:
        label, job, sessions = item
        try:
            handle = submit_job(job, sessions)
        except NebulaError as exc:
            SUBMIT_FAILURES.append({"job": label, "at": time.strftime("%H:%M:%S"), "reason": str(exc)})
            return
        handles[label] = handle
        followers[label] = JobFollower(handle.job.job_id, handle.stages, give_up_s=timeout)

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        list(pool.map(submit, jobs))
    followers = {label: followers[label] for label, _, _ in jobs if label in followers}
    background = tuple(b for b in background if b in handles)
    deadline = time.monotonic() + timeout
    for label, follower in followers.items():
        if label not in background:
            follower.wait(max(1.0, deadline - time.monotonic()))
    for label in background:
        handles[label].cancel()
        followers[label].wait(60)
    return followers


def overlap_window(followers: dict[str, JobFollower], stage: str = "head") -> tuple[float, float] | None:
    """The time every job was past its second step and none had finished yet (None: they never overlapped)."""
    starts, ends = [], []
    for f in followers.values():
        times = f.step_times(stage)
        if len(times) < 3:
            return None
        starts.append(times[1])
        ends.append(times[-1])
    start, end = max(starts), min(ends)
    return (start, end) if end - start > 1.0 else None


def summary(
    followers: dict[str, JobFollower], stage: str = "head", window: bool = True
) -> dict[str, dict[str, Any]]:
    """Per job: mean step time while every job of the set was running (``window``), else after step 2."""
    out = {}
    both = overlap_window(followers, stage) if window and len(followers) > 1 else None
    for label, f in followers.items():
        # The trainer's own per-step wall time: on a loaded machine status updates reach this process
        # late and in batches, so arrival times understate or overstate single steps.
        mean = f.mean_reported_step_seconds(stage)
        arrival_mean = f.mean_step_seconds(stage)
        if both is not None:
            inside = [t for t in f.step_times(stage) if both[0] <= t <= both[1]]
            if len(inside) >= 2:
                arrival_mean = (inside[-1] - inside[0]) / (len(inside) - 1)
        states = {o["state"] for o in f.outcome().values()}
        out[label] = {
            "mean_step_s": round(mean, 4) if mean else None,
            "steps": f.done_steps(stage),
            "state": "/".join(sorted(states)) or "unfinished",
            "messages": sorted({o["message"][:200] for o in f.outcome().values() if o["message"]}),
            "duration_s": round(max(f.final_at.values()) - f.t0, 2) if f.final_at else None,
            "overlap_window_s": round(both[1] - both[0], 1) if both else None,
            "arrival_mean_step_s": round(arrival_mean, 4) if arrival_mean else None,
            "reported_steps": len(f.reported[stage]),
        }
    return out


def audit_records(path: Path, event: str, prefix: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("event") == event and str(r.get("job_id", "")).startswith(prefix)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--render", type=Path, help="only recompute the tables, PNG and markdown from a JSON")
    parser.add_argument("--flood-rate", type=float, default=0.0, help="flooder frames/s (0: flat out)")
    parser.add_argument("--rounds", type=int, default=2, help="slow mix / full mix pairs, in turn")
    parser.add_argument("--tag", default="", help="suffix of the output files (faults-fairness-TAG.*)")
    parser.add_argument("--flood", metavar="ADDRESS", help=argparse.SUPPRESS)  # the flooder subprocess
    parser.add_argument("--token-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--flood-prefix", default="flood", help=argparse.SUPPRESS)  # job ids of one round
    parser.add_argument("--flood-tls-dir", type=Path, help=argparse.SUPPRESS)  # a trainer's internal identity
    args = parser.parse_args()
    if args.render:
        result = json.loads(args.render.read_text())
        result["per_job"], result["fairness"] = derive(
            result["alone"]["healthy"][next(iter(result["alone"]["healthy"]))]["mean_step_s"],
            result["healthy_mix"],
            rounds_of(result),
        )
        write_json(args.render, result)
        render(args.render.with_suffix(".png"), result["samples"], result["marks_s"])
        args.render.with_suffix(".md").write_text(report(result, args.render.stem))
        return
    if args.flood:
        flood_process(
            args.flood,
            args.token_file.read_text().strip(),
            args.result,
            args.flood_rate,
            args.flood_prefix,
            args.flood_tls_dir,
        )
        return
    stem = "faults-fairness" + (f"-{args.tag}" if args.tag else "")
    run_dir = args.out / f"run-{stem}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    started = time.time()
    log_lines: list[str] = []

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        log_lines.append(line)

    load_before = load_info()
    timeout = 900.0
    with LocalDeployment(run_dir=run_dir, bandwidth_mbit=BANDWIDTH_MBIT, delay_ms=DELAY_MS) as deployment:
        users = {u: {c: make_user(deployment, c, u) for c in ("a", "b")} for u in ACCOUNTS}
        mallory = make_user(deployment, "a", "mallory")
        # The dialing switch's link connections (its default, `auto`, adds some only for a link-bound path).
        url = deployment.endpoints("a").metrics.get("switch-a", "")
        gauges = {"connections": lambda: switch_connections(url)}
        sampler = ProcessSampler(deployment, ["switch-a", "switch-b"], 0.5, gauges).start()
        marks: dict[str, float] = {}

        def healthy(n: int) -> list[tuple[str, ProgramJob, dict[str, ClusterSession]]]:
            jobs = []
            for i in range(n):
                owner = ACCOUNTS[i % 4]
                jobs.append((f"{owner}/job{i}", healthy_job(i % 4, i, args.steps), users[owner]))
            return jobs

        marks["alone_start"] = time.monotonic() - sampler.t0
        alone = run_jobs(healthy(1), timeout)
        alone_slow = run_jobs([("user3/slow", slow_job(), users["user3"])], timeout)
        log(f"alone: {summary(alone)} slow: {summary(alone_slow)}")
        marks["healthy_mix_start"] = time.monotonic() - sampler.t0
        loads: dict[str, Any] = {}
        phase_load = {"healthy_mix": load_info()}
        healthy_mix = run_jobs(healthy(15), timeout)
        log(f"healthy mix: {summary(healthy_mix)}")
        loads["healthy_mix"] = {"start": phase_load["healthy_mix"], "end": load_info()}
        token_file = run_dir / "flooder-token"
        token_file.write_text(mallory.token)
        rounds: list[dict[str, Any]] = []
        for k in range(1, args.rounds + 1):
            marks[f"slow_mix_{k}_start"] = time.monotonic() - sampler.t0
            slow_load = load_info()
            slow = ("user3/slow", slow_job(SLOW_MIX_STEPS), users["user3"])
            slow_mix = run_jobs([slow, *healthy(15)], timeout, background=("user3/slow",))
            log(f"round {k}, healthy + slow mix: {summary(slow_mix)}")
            marks[f"full_mix_{k}_start"] = time.monotonic() - sampler.t0
            full_load = load_info()
            # Only a trainer's certificate may open an edge: the flooder uses trainer a's (service port).
            address = f"127.0.0.1:{deployment.process('switch-a').info['service_port']}"
            args.flood_tls_dir = service_tls_dir(deployment.pki_dir, "a", "trainer")
            full_mix, flooder = flooded_mix(
                address, token_file, run_dir / f"flooder-{k}.json", args, users, healthy
            )
            marks[f"full_mix_{k}_end"] = time.monotonic() - sampler.t0
            log(f"round {k}, full mix: {summary(full_mix)}")
            log(f"round {k}, flooder: {json.dumps(flooder)[:600]}")
            rounds.append(
                {
                    "slow_mix": summary(slow_mix),
                    "full_mix": summary(full_mix),
                    "flooder": flooder,
                    "load": {
                        "slow_mix": {"start": slow_load, "end": full_load},
                        "full_mix": {"start": full_load, "end": load_info()},
                    },
                }
            )
        time.sleep(3.0)
        samples = sampler.stop()
        audit = {
            c: audit_records(run_dir / c / "switch" / "audit.log", "route.closed", "flood")
            for c in ("a", "b")
        }
        penalty_audit = {
            event: audit_records(run_dir / "a" / "switch" / "audit.log", event, "flood")
            for event in ("account.penalty", "edge.open")
        }
    load_after = load_info()
    result = assemble(
        args,
        started,
        load_before,
        load_after,
        alone,
        alone_slow,
        healthy_mix,
        rounds,
        samples,
        marks,
    )
    result["loads"] = loads
    result["audit_route_closed"] = audit
    refused = [r for r in penalty_audit["edge.open"] if r.get("outcome") == "refused"]
    result["penalty_audit"] = {
        "account.penalty": penalty_audit["account.penalty"][:3],
        "account.penalty_count": len(penalty_audit["account.penalty"]),
        "edge.open_refused": refused[:3],
        "edge.open_refused_count": len(refused),
    }
    result["log"] = log_lines
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / f"{stem}.json", result)
    render(args.out / f"{stem}.png", samples, marks)
    (args.out / f"{stem}.md").write_text(report(result, stem))
    print(report(result))


def flooded_mix(
    address: str,
    token_file: Path,
    flood_result: Path,
    args: argparse.Namespace,
    users: dict[str, dict[str, ClusterSession]],
    healthy: Any,
) -> tuple[dict[str, JobFollower], dict[str, Any]]:
    """The slow mix with the flooder process running (started 2 s before the jobs, stopped after)."""
    flood = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "--flood",
            address,
            "--token-file",
            str(token_file),
            "--result",
            str(flood_result),
            "--flood-rate",
            str(args.flood_rate),
            "--flood-prefix",
            flood_result.stem.replace("flooder", "flood-r"),
            "--flood-tls-dir",
            str(args.flood_tls_dir),
        ]
    )
    try:
        time.sleep(2.0)  # the flood is on before the jobs start
        slow = ("user3/slow", slow_job(SLOW_MIX_STEPS), users["user3"])
        full_mix = run_jobs([slow, *healthy(15)], 900.0, background=("user3/slow",))
    finally:
        flood.send_signal(signal.SIGTERM)
        try:
            flood.wait(30)
        except subprocess.TimeoutExpired:
            flood.kill()
            flood.wait(5)
    flooder = json.loads(flood_result.read_text()) if flood_result.exists() else {"error": "no result"}
    return full_mix, flooder


def rounds_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The slow/full rounds of a result (a result of one round, before ``--rounds``, has no list)."""
    return result.get("rounds") or [{"slow_mix": result["slow_mix"], "full_mix": result["full_mix"]}]


def assemble(
    args: argparse.Namespace,
    started: float,
    load_before: dict[str, Any],
    load_after: dict[str, Any],
    alone: dict[str, JobFollower],
    alone_slow: dict[str, JobFollower],
    healthy_mix: dict[str, JobFollower],
    rounds: list[dict[str, Any]],
    samples: list[dict[str, Any]],
    marks: dict[str, float],
) -> dict[str, Any]:
    alone_s = summary(alone)
    base = next(iter(alone_s.values()))["mean_step_s"]
    slow_alone = summary(alone_slow).get("user3/slow", {}).get("mean_step_s")
    hm = summary(healthy_mix)
    sm, fm = rounds[0]["slow_mix"], rounds[0]["full_mix"]
    per_job, fairness = derive(base, hm, rounds)
    cpu: dict[str, dict[str, float]] = {}
    phases = [("healthy_mix", "healthy_mix_start", "slow_mix_1_start")]
    for k in range(1, len(rounds) + 1):
        phases.append((f"slow_mix_{k}", f"slow_mix_{k}_start", f"full_mix_{k}_start"))
        phases.append((f"full_mix_{k}", f"full_mix_{k}_start", f"full_mix_{k}_end"))
    for name in ("switch-a", "switch-b"):
        rows = [r for r in samples if r["name"] == name]
        cpu[name] = {}
        for phase, start, end in phases:
            inside = [r for r in rows if marks[start] <= r["t"] <= marks[end]]
            if len(inside) >= 2:
                span = inside[-1]["t"] - inside[0]["t"]
                used = inside[-1]["cpu_s"] - inside[0]["cpu_s"]
                cpu[name][phase] = round(used / span, 3) if span > 0 else 0.0
    link_connections: dict[str, dict[str, Any]] = {}
    for phase, start, end in phases:
        values = [
            r["value"]
            for r in samples
            if r["name"] == "connections" and marks[start] <= r["t"] <= marks[end] and r["value"] is not None
        ]
        if values:
            link_connections[phase] = {
                "max": max(values),
                "above_one": sum(v > 1 for v in values),
                "samples": len(values),
            }
    switch_stats = {}
    for name in ("switch-a", "switch-b"):
        rows = [r for r in samples if r["name"] == name]
        switch_stats[name] = {
            "rss_kib_min": min(r["rss_kib"] for r in rows),
            "rss_kib_max": max(r["rss_kib"] for r in rows),
            "fds_min": min(r["fds"] for r in rows),
            "fds_max": max(r["fds"] for r in rows),
            "threads_max": max(r["threads"] for r in rows),
            "samples": len(rows),
        }
    result = {
        "benchmark": "faults-fairness",
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wan": {"bandwidth_mbit": BANDWIDTH_MBIT, "delay_ms": DELAY_MS},
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": load_after,
        "healthy_job": {"spec": "examples/digit_sum/job.yaml", "steps": args.steps},
        "slow_job": {"spec": "examples/slow_receiver/job.yaml", "steps": args.steps, "sleep_s": SLOW_SLEEP_S},
        "alone": {"healthy": alone_s, "slow": summary(alone_slow)},
        "healthy_mix": hm,
        "slow_mix": sm,
        "full_mix": fm,
        "rounds": rounds,
        "switch_cpu_cores": cpu,
        "link_connections_switch_a": link_connections,
        "per_job": per_job,
        "fairness": fairness,
        "slow_receiver": {"alone_s": slow_alone, "full_mix_s": fm.get("user3/slow", {}).get("mean_step_s")},
        "flooder": rounds[0]["flooder"],
        "flood_rate": args.flood_rate or "flat out",
        "flooder_nice": FLOODER_NICE,
        "submit_failures": SUBMIT_FAILURES,
        "switch": switch_stats,
        "stated_bound_bytes": STATED_BOUND_BYTES,
        "marks_s": marks,
        "samples": samples,
    }
    return result


def render(path: Path, samples: list[dict[str, Any]], marks: dict[str, float]) -> None:
    width, height = 1200, 500
    canvas = Canvas(width, height)
    samples = [r for r in samples if r["name"] in ("switch-a", "switch-b")]  # not the gauges' rows
    t_end = max((r["t"] for r in samples), default=1.0)
    panels = (("rss_kib", (60, 20, width - 20, 230)), ("fds", (60, 270, width - 20, height - 20)))
    rounds = sorted(int(k.split("_")[2]) for k in marks if k.startswith("full_mix_") and k.endswith("_end"))
    for key, box in panels:
        peak = max((r[key] for r in samples), default=1)
        plot = Plot(canvas, box, (0.0, t_end), (0, peak * 1.05))
        plot.span(marks["healthy_mix_start"], marks.get("slow_mix_1_start", t_end), PALETTE["gap"])
        for k in rounds:
            plot.span(marks[f"slow_mix_{k}_start"], marks[f"full_mix_{k}_start"], PALETTE["kill"])
            plot.span(marks[f"full_mix_{k}_start"], marks[f"full_mix_{k}_end"], PALETTE["cut"])
        for name, colour in (("switch-a", "red"), ("switch-b", "orange")):
            plot.points([(r["t"], r[key]) for r in samples if r["name"] == name], PALETTE[colour], join=True)
        plot.xticks(10.0)
    canvas.save(path)


def report(r: dict[str, Any], stem: str = "faults-fairness") -> str:
    rounds = rounds_of(r)
    n = len(rounds)
    head = ["job", "alone ms", "15 healthy ms"]
    for k in range(1, n + 1):
        head += [f"+ slow ms ({k})", f"+ slow + flood ms ({k})", f"flood / slow ({k})"]
    head += ["+ slow + flood / 15 healthy (1)", "state"]
    rows = []
    for p in r["per_job"]:
        row = [p["job"], ms(p["alone_s"]), ms(p["healthy_mix_s"])]
        for k in range(1, n + 1):
            row += [ms(p.get(f"slow_mix_{k}_s")), ms(p.get(f"full_mix_{k}_s")), p.get(f"full_over_slow_{k}")]
        row += [p["full_mix_over_healthy_mix"], p["state"]]
        rows.append(row)
    ratios = {
        k: [p[f"full_over_slow_{k}"] for p in r["per_job"] if p.get(f"full_over_slow_{k}")]
        for k in range(1, n + 1)
    }
    loads = []
    for k, rd in enumerate(rounds, 1):
        load = rd.get("load", {})
        if load:
            loads.append(
                f"round {k}: slow mix {load['slow_mix']['start']['loadavg_1m']} -> "
                f"{load['slow_mix']['end']['loadavg_1m']}, "
                f"full mix {load['full_mix']['start']['loadavg_1m']} -> "
                f"{load['full_mix']['end']['loadavg_1m']}"
            )
    flooder_lines = []
    for k, rd in enumerate(rounds, 1):
        f = rd.get("flooder", r.get("flooder", {}))
        entries = f.get("closes", [])
        closed = [e for e in entries if e.get("reason")]
        refused = [e for e in entries if "RESOURCE_EXHAUSTED" in str(e.get("rpc_error", ""))]
        first_close = closed[0] if closed else {}
        first_refusal = refused[0] if refused else {}
        flooder_lines.append(
            f"- Flooder, round {k} ({r.get('flood_rate', 'flat out')} frames/s): "
            f"{f.get('frames_sent')} frames sent in {f.get('seconds')} s ({f.get('cpu_s')} CPU-s at nice "
            f"{r.get('flooder_nice', 0)}); "
            f"{len(closed)} edge(s) closed by a bound, {len(refused)} open(s) refused by the penalty "
            "backoff; "
            f"first close after {first_close.get('closed_after_s')} s: `{first_close.get('reason')}`; "
            f"first refusal: `{first_refusal.get('rpc_error')}`."
        )
    sw = r["switch"]
    audit = r["audit_route_closed"]
    first_audit = next((recs[0] for recs in audit.values() if recs), None)
    penalty = r.get("penalty_audit", {})
    first_penalty = (penalty.get("account.penalty") or [None])[0]
    bound_mib = r["stated_bound_bytes"] / (1 << 20)
    fair = r["fairness"]
    return "\n".join(
        [
            "# 16 concurrent jobs, a slow receiver and a flooder through one switch pair",
            "",
            f"15 healthy `examples/digit_sum` jobs ({r['healthy_job']['steps']} steps) of 4 accounts "
            f"(user0..user3) + one `examples/slow_receiver` job of user3 (its downstream stage sleeps "
            f"{r['slow_job']['sleep_s']} s per micro-batch) + a flooder (raw `Relay.OpenEdge` client of a "
            "fifth account, `mallory`, on switch a; header-only frames flat out on an edge whose peer never "
            "attaches, re-opened 0.2 s after each close or refusal; its process runs at nice "
            f"{r.get('flooder_nice', 0)}, standing for a flooder on another host). "
            f"WAN {r['wan']['bandwidth_mbit']:.0f} Mbit/s, {r['wan']['delay_ms']:.0f} ms one-way; "
            f"{r['cpus']} CPUs shared with other engineers (load average before "
            f"{r['load_before']['loadavg_1m']}, after {r['load_after']['loadavg_1m']}). "
            f"Run {r['started_utc']}; `bench/faults/fairness.py --rounds {n}`.",
            "",
            "Step time = mean of the per-step wall times the downstream trainer reported "
            "(`StageStatus.step_seconds`, steps after the second). Phases: one healthy job alone; the"
            " 15 healthy jobs together (what 15 jobs cost each other in CPU: every trainer computes on the "
            f"same 2 cores, which no switch can hide); then {n} round(s) of (+ the slow receiver; + the slow "
            "receiver + the flooder), in turn, so that the flooder's cost is read side by side: **flood / "
            "slow (k)** is each job's step time with the flooder over its step time in the slow mix just "
            "before it (the machine is shared; its load moves between phases minutes apart).",
            "",
            md_table(head, rows),
            "",
            *[
                f"- Flood / slow, round {k}: {min(v):.3f}-{max(v):.3f} (mean {sum(v) / len(v):.3f}) over "
                f"{len(v)} healthy jobs (target: within 1.2)."
                for k, v in ratios.items()
                if v
            ],
            f"- Load average (1 min) per phase: {'; '.join(loads) or 'not recorded'}.",
            "- Jain's fairness index over the healthy jobs' throughput: "
            + ", ".join(f"{k} {v:.4f}" for k, v in fair.items() if k[-1].isdigit() or k == "healthy_mix")
            + " (target >= 0.95).",
            f"- Switch CPU (cores used on average, per phase): {json.dumps(r['switch_cpu_cores'])}.",
            "- Switch a's link connections (`nebula_switch_link_connections`, read every 0.5 s), per phase: "
            + (
                "; ".join(
                    f"{phase} at most {v['max']:g} ({v['above_one']} of {v['samples']} readings above 1)"
                    for phase, v in r.get("link_connections_switch_a", {}).items()
                )
                or "not read"
            )
            + ".",
            f"- Submissions that failed: {len(r['submit_failures'])} "
            f"{[(f['job'], f['reason'][:160]) for f in r['submit_failures']]}.",
            f"- Slow receiver: {ms(r['slow_receiver']['alone_s'])} ms per step alone, "
            f"{ms(r['slow_receiver']['full_mix_s'])} ms in the first full mix (cancelled on purpose when "
            "the healthy jobs were done).",
            *flooder_lines,
            f"- Audit `route.closed` for the flooder: switch a {len(audit['a'])} record(s), "
            f"switch b {len(audit['b'])}; first: `{json.dumps(first_audit)[:500] if first_audit else None}`.",
            f"- Penalty audit on switch a: {penalty.get('account.penalty_count')} `account.penalty` "
            "record(s), "
            f"{penalty.get('edge.open_refused_count')} refused `edge.open` record(s) (one per backoff); "
            "first "
            f"penalty: `{json.dumps(first_penalty)[:500] if first_penalty else None}`.",
            f"- Switch RSS: a {mib(sw['switch-a'])} MiB, b {mib(sw['switch-b'])} MiB "
            f"(stated bound of buffered items: {bound_mib:.0f} MiB per switch, docs/data-plane.md); "
            "open fds "
            f"a {sw['switch-a']['fds_min']}-{sw['switch-a']['fds_max']}, b {sw['switch-b']['fds_min']}-"
            f"{sw['switch-b']['fds_max']}; threads max a {sw['switch-a']['threads_max']}, "
            f"b {sw['switch-b']['threads_max']}.",
            "",
            f"![switch RSS and fds]({stem}.png)",
            "",
            "Figure (no text: rendered without matplotlib): top, switch RSS; bottom, switch open fds; x = "
            "seconds, ticks every 10 s; red switch-a, orange switch-b; yellow span = 15 healthy jobs, "
            "light blue = + slow receiver, pink = + slow receiver + flooder (one pair per round).",
            "",
        ]
    )


def derive(
    base: float | None, hm: dict[str, Any], rounds: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per healthy job: step times per phase and their ratios; Jain's index per phase.

    ``full_over_slow`` is the flooder's cost read side by side: each full mix over the slow mix run
    just before it (same jobs, same slow receiver, minutes apart on the shared machine).
    """
    mixes = [hm] + [r[m] for r in rounds for m in ("slow_mix", "full_mix")]
    labels = list(dict.fromkeys(k for m in mixes for k in m if not k.endswith("slow")))

    def step(m: dict[str, Any], label: str) -> float | None:
        return m.get(label, {}).get("mean_step_s")

    def ratio(a: float | None, b: float | None, digits: int = 3) -> float | None:
        return round(a / b, digits) if a and b else None

    per_job = []
    for label in labels:
        row: dict[str, Any] = {"job": label, "alone_s": base, "healthy_mix_s": step(hm, label)}
        for k, r in enumerate(rounds, 1):
            row[f"slow_mix_{k}_s"] = step(r["slow_mix"], label)
            row[f"full_mix_{k}_s"] = step(r["full_mix"], label)
            row[f"full_over_slow_{k}"] = ratio(step(r["full_mix"], label), step(r["slow_mix"], label))
            row[f"full_over_healthy_{k}"] = ratio(step(r["full_mix"], label), step(hm, label))
            row[f"slow_over_healthy_{k}"] = ratio(step(r["slow_mix"], label), step(hm, label))
        # The first round under the old names (earlier reports and faults.md read these).
        row["slow_mix_s"], row["full_mix_s"] = row["slow_mix_1_s"], row["full_mix_1_s"]
        row["slow_mix_over_healthy_mix"] = row["slow_over_healthy_1"]
        row["full_mix_over_healthy_mix"] = row["full_over_healthy_1"]
        row["full_mix_over_alone"] = ratio(row["full_mix_1_s"], base, 2)
        row["state"] = "/".join(
            sorted({r["full_mix"].get(label, {}).get("state", "not admitted") for r in rounds})
        )
        per_job.append(row)

    def fair(m: dict[str, Any]) -> float:
        return jain([1 / v for v in (step(m, k) for k in labels) if v])

    fairness: dict[str, Any] = {"healthy_mix": fair(hm)}
    for k, r in enumerate(rounds, 1):
        fairness[f"slow_mix_{k}"] = fair(r["slow_mix"])
        fairness[f"full_mix_{k}"] = fair(r["full_mix"])
    fairness["slow_mix"], fairness["full_mix"] = fairness["slow_mix_1"], fairness["full_mix_1"]
    return per_job, fairness


def mib(stats: dict[str, Any]) -> str:
    return f"{stats['rss_kib_min'] / 1024:.0f}-{stats['rss_kib_max'] / 1024:.0f}"


def ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1000:.0f}"


if __name__ == "__main__":
    main()
