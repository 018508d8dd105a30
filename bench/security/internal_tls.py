"""What internal TLS costs: the demo job's step time with TLS vs plaintext internal ports, side by side.

    make bench-internal-tls                      # = this script, pinned with taskset, report in docs/bench/
    python bench/security/internal_tls.py --pairs 8 --steps 60 --cpus 0,1 --out bench-results/internal-tls

Two real two-cluster deployments (``LocalDeployment``, every service its own process, the WAN emulator
between the switches, the demo's 60 Mbit/s and 20 ms) run at the same time: one with internal TLS on
every port (the default), one with plaintext internal ports (the development flag
``NEBULA_INTERNAL_PLAINTEXT=1``, set only for it). The demo's built-in ``numbers`` job then runs on
them in interleaved pairs; the order inside a pair alternates (TLS first, then plaintext first) so a
drift of the machine's load hits both modes alike. Everything (this process and every service it
starts) is pinned to the same cores (``--cpus``, ``sched_setaffinity`` = ``taskset``).

Per job: the median step time (the loss-owning stage's own step time, steps after ``--warmup``) and
the CPU-seconds per step of all processes of that deployment plus this process (the client), read from
``/proc/<pid>/stat`` at the first and last measured step. CPU time does not depend on how busy the
rest of the machine is, so it shows the cost of TLS even when the wall-clock times are noisy.

Per pair: the ratio TLS / plaintext of the median step times; over the pairs the median and spread.

A micro-benchmark then measures one unary and one streaming call over the internal ports' own TLS
stack (``ServerTls`` credentials with client authentication, ``ClientTls`` + ``internal_channel`` on a
kept channel, exactly what services use) against plaintext, interleaved the same way: unary latency,
a new channel per call (the full handshake), and MB/s of a client stream of 1 MiB messages.

Writes ``internal-tls.json`` and ``internal-tls.md`` to ``--out`` and, with ``--doc``, the report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from nebula_common.cli.job import onboard
from nebula_common.jobspec import load_spec
from nebula_common.jobspec.builtin import builtin_spec
from nebula_common.launcher import LocalDeployment
from nebula_common.pki.service_identity import ServiceTlsFiles, issue_service_certificate
from nebula_common.pki.store import init_pki
from nebula_common.rpc.channels import internal_channel_options
from nebula_common.rpc.internal_tls import PLAINTEXT_ENV, ClientTls, ServerTls, internal_channel
from nebula_common.sdk.client import ClusterSession, submit_job
from nebula_common.sdk.jobs import ProgramJob
from nebula_common.sdk.summary import summarize

MODES = ("tls", "plaintext")
SCHEDULES = ("sequential", "concurrent")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | None) -> float:
    """utime + stime of a process (all its threads) from /proc; 0 if it is gone."""
    if pid is None:
        return 0.0
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": field 3 is fields[0]
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


@dataclass
class Mode:
    name: str
    deployment: LocalDeployment
    sessions: dict[str, ClusterSession] = field(default_factory=dict)

    with_client: bool = True  # False when both modes' jobs run at once (one client process for both)

    def cpu(self) -> dict[str, float]:
        """CPU-seconds so far of every process of this deployment, and of this process (the client)."""
        out = {p.name: cpu_seconds(p.pid) for p in self.deployment.all_processes()}
        if self.with_client:
            out["client"] = cpu_seconds(os.getpid())
        return out


def numbers_job(steps: int) -> ProgramJob:
    return ProgramJob(load_spec(builtin_spec("numbers"), {"steps": steps}))


def run_job(mode: Mode, steps: int, warmup: int) -> dict[str, Any]:
    """One demo job on ``mode``'s deployment: median step time and CPU-seconds per measured step."""
    job = numbers_job(steps)
    marks: dict[str, Any] = {}

    def on_step(status: Any) -> None:
        if status.steps_done == warmup:
            marks["start"] = (time.perf_counter(), mode.cpu())
        elif status.steps_done == steps:
            marks["end"] = (time.perf_counter(), mode.cpu())

    load_before = load()
    summary = summarize(job, submit_job(job, mode.sessions), on_step=on_step)
    if not summary.succeeded or "start" not in marks or "end" not in marks:
        raise SystemExit(f"{mode.name}: the job did not finish: {summary.stage_messages}")
    measured = steps - warmup
    (t0, cpu0), (t1, cpu1) = marks["start"], marks["end"]
    per_process = {name: (cpu1[name] - cpu0.get(name, 0.0)) / measured for name in cpu1}
    step_times = summary.step_seconds[warmup:]
    return {
        "mode": mode.name,
        "median_step_ms": statistics.median(step_times) * 1000,
        "mean_step_ms": statistics.fmean(step_times) * 1000,
        "wall_per_step_ms": (t1 - t0) / measured * 1000,
        "cpu_seconds_per_step": sum(per_process.values()),
        "cpu_seconds_per_step_by_process": {k: round(v, 5) for k, v in sorted(per_process.items())},
        "final_loss": summary.losses[-1],
        "load_before": load_before,
        "load_after": load(),
    }


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def job_benchmark(args: argparse.Namespace, root: Path, schedule: str) -> dict[str, Any]:
    """Pairs of jobs, one per mode: one after the other (``sequential``) or both at once (``concurrent``).

    Concurrent pairs see the same load at the same moment (and share the cores equally), so their
    ratio is far less exposed to the load of other work drifting between the two runs.
    """
    modes: dict[str, Mode] = {}
    root = root / schedule
    try:
        # TLS first, without the flag; then the flag, for the plaintext deployment (its services inherit
        # it) and for this process's plaintext client channels. TLS channels stay TLS: the TLS deployment's
        # ports are registered with their CA (trust_endpoint), which the flag does not override.
        tls = LocalDeployment(
            run_dir=root / "tls", bandwidth_mbit=args.bandwidth_mbit, delay_ms=args.delay_ms
        )
        modes["tls"] = Mode("tls", tls)
        tls.start()
        os.environ[PLAINTEXT_ENV] = "1"
        plain = LocalDeployment(
            run_dir=root / "plaintext",
            bandwidth_mbit=args.bandwidth_mbit,
            delay_ms=args.delay_ms,
            internal_tls=False,
        )
        modes["plaintext"] = Mode("plaintext", plain)
        plain.start()
        for mode in modes.values():
            state = mode.deployment.cluster_state
            mode.sessions = {
                c: onboard(mode.deployment.endpoints(c), state[c].admin_password, f"bench-{mode.name}-{c}")
                for c in mode.deployment.clusters
            }
        print("warm-up: one short job per mode", file=sys.stderr)
        for mode in modes.values():
            run_job(mode, args.warmup + 2, args.warmup)
        pairs = []
        for i in range(args.pairs):
            order = MODES if i % 2 == 0 else MODES[::-1]
            if schedule == "concurrent":
                for mode in modes.values():
                    mode.with_client = False
                with futures.ThreadPoolExecutor(max_workers=2) as pool:
                    started = {}
                    for name in order:  # submitted in this order, a moment apart
                        started[name] = pool.submit(run_job, modes[name], args.steps, args.warmup)
                    runs = {name: started[name].result() for name in MODES}
            else:
                runs = {name: run_job(modes[name], args.steps, args.warmup) for name in order}
            ratio = runs["tls"]["median_step_ms"] / runs["plaintext"]["median_step_ms"]
            cpu_ratio = runs["tls"]["cpu_seconds_per_step"] / runs["plaintext"]["cpu_seconds_per_step"]
            pairs.append(
                {"pair": i + 1, "order": list(order), **runs, "ratio": ratio, "cpu_ratio": cpu_ratio}
            )
            print(
                f"{schedule} pair {i + 1}: TLS {runs['tls']['median_step_ms']:.1f} ms, plaintext "
                f"{runs['plaintext']['median_step_ms']:.1f} ms, ratio {ratio:.3f}; CPU/step TLS "
                f"{runs['tls']['cpu_seconds_per_step']:.3f} s, "
                f"plaintext {runs['plaintext']['cpu_seconds_per_step']:.3f} s"
                f" (load {runs['plaintext']['load_after'][0]})",
                file=sys.stderr,
            )
    finally:
        for mode in modes.values():
            for session in mode.sessions.values():
                session.close()
            mode.deployment.stop()
        os.environ.pop(PLAINTEXT_ENV, None)
    by_process: dict[str, dict[str, float]] = {}
    for name in MODES:
        names = pairs[0][name]["cpu_seconds_per_step_by_process"]
        by_process[name] = {
            p: statistics.median(pair[name]["cpu_seconds_per_step_by_process"][p] for pair in pairs)
            for p in names
        }
    return {
        "schedule": schedule,
        "pairs": pairs,
        "ratio": spread([p["ratio"] for p in pairs]),
        "cpu_ratio": spread([p["cpu_ratio"] for p in pairs]),
        "median_step_ms": {m: statistics.median(p[m]["median_step_ms"] for p in pairs) for m in MODES},
        "cpu_seconds_per_step": {
            m: statistics.median(p[m]["cpu_seconds_per_step"] for p in pairs) for m in MODES
        },
        "cpu_seconds_per_step_by_process": by_process,
        "final_losses": sorted({round(p[m]["final_loss"], 6) for p in pairs for m in MODES}),
    }


# ------------------------------------------------------------------ micro-benchmark

SERVICE = "nebula.bench.Echo"


def _echo_server(credentials: grpc.ServerCredentials | None) -> tuple[grpc.Server, str]:
    def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
        return request

    def upload(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        total = sum(len(r) for r in requests)
        return total.to_bytes(8, "big")

    ident: Callable[[bytes], bytes] = bytes
    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary, ident, ident),
            "Upload": grpc.stream_unary_rpc_method_handler(upload, ident, ident),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=internal_channel_options())
    server.add_generic_rpc_handlers((handler,))
    port = (
        server.add_secure_port("127.0.0.1:0", credentials)
        if credentials is not None
        else server.add_insecure_port("127.0.0.1:0")
    )
    server.start()
    return server, f"127.0.0.1:{port}"


def _channel(address: str, tls: ClientTls | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=internal_channel_options())
    return internal_channel(address, service="switch", tls=tls)  # type: ignore[return-value]


def _micro_round(address: str, tls: ClientTls | None, calls: int, stream_mb: int) -> dict[str, float]:
    payload = b"x" * 256
    chunk = b"\0" * (1 << 20)
    with _channel(address, tls) as channel:
        unary = channel.unary_unary(f"/{SERVICE}/Unary")
        upload = channel.stream_unary(f"/{SERVICE}/Upload")
        unary(payload, timeout=30)  # connect + handshake outside the measurement
        latencies = []
        for _ in range(calls):
            t = time.perf_counter()
            unary(payload, timeout=30)
            latencies.append(time.perf_counter() - t)
        cpu0, t0 = time.process_time(), time.perf_counter()
        total = int.from_bytes(upload(iter([chunk] * stream_mb), timeout=120), "big")
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        assert total == stream_mb << 20, total
    fresh = []
    for _ in range(max(3, calls // 50)):
        t = time.perf_counter()
        with _channel(address, tls) as channel:  # a new channel per call: connect + full handshake
            channel.unary_unary(f"/{SERVICE}/Unary")(payload, timeout=30)
        fresh.append(time.perf_counter() - t)
    return {
        "unary_median_us": statistics.median(latencies) * 1e6,
        "unary_new_channel_median_ms": statistics.median(fresh) * 1e3,
        "stream_mb_per_s": stream_mb / seconds,
        "stream_cpu_seconds_per_gb": cpu / stream_mb * 1024,
    }


def micro_benchmark(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Unary + streaming over the internal ports' TLS stack vs plaintext, interleaved rounds."""
    pki = root / "micro-pki"
    init_pki(pki, ["a", "b"])
    server_files = issue_service_certificate(pki, "a", "switch", by="bench")
    client_files = issue_service_certificate(pki, "a", "trainer", by="bench")
    assert isinstance(server_files, ServiceTlsFiles)
    server_tls = ServerTls(server_files)
    client_tls = ClientTls.for_service(client_files, "a")
    tls_server, tls_address = _echo_server(server_tls.credentials(require_client_auth=True))
    plain_server, plain_address = _echo_server(None)
    rounds: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    try:
        for i in range(args.micro_rounds):
            order = MODES if i % 2 == 0 else MODES[::-1]
            for name in order:
                if name == "tls":
                    rounds[name].append(
                        _micro_round(tls_address, client_tls, args.micro_calls, args.micro_mb)
                    )
                else:
                    rounds[name].append(_micro_round(plain_address, None, args.micro_calls, args.micro_mb))
    finally:
        tls_server.stop(None)
        plain_server.stop(None)
    keys = rounds["tls"][0].keys()
    return {
        "rounds": rounds,
        "median": {m: {k: statistics.median(r[k] for r in rounds[m]) for k in keys} for m in MODES},
        "calls_per_round": args.micro_calls,
        "stream_mb_per_round": args.micro_mb,
    }


# ------------------------------------------------------------------ report


def _env_line(env: dict[str, Any]) -> str:
    return (
        f"Run at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(env['started_unix']))} on "
        f"{env['cpus_online']} cores, every process pinned to cores {env['cpus']}; load average (1/5/15 min) "
        f"{env['load_before']} before, {env['load_after']} after (other work shares the machine)."
    )


def _jobs_section(jobs: dict[str, Any]) -> list[str]:
    env, schedule = jobs["environment"], jobs["schedule"]
    how = (
        "both jobs of a pair run AT THE SAME TIME (each on its own deployment), so both see the same load"
        if schedule == "concurrent"
        else "the jobs of a pair run one after the other, the order alternating from pair to pair"
    )
    lines = [
        f"## {schedule.capitalize()} pairs",
        "",
        f"{_env_line(env)} The demo's built-in `numbers` job, {env['steps']} steps (the first "
        f"{env['warmup']} not measured), WAN {env['bandwidth_mbit']:g} Mbit/s and {env['delay_ms']:g} ms one "
        f"way; a TLS and a plaintext deployment up at once; {len(jobs['pairs'])} pairs; {how}.",
        "",
        "| pair | order | TLS median step | plaintext median step | ratio TLS/plaintext | TLS CPU-s/step | "
        "plaintext CPU-s/step | CPU ratio | load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in jobs["pairs"]:
        lines.append(
            f"| {p['pair']} | {' then '.join(p['order'])} | {p['tls']['median_step_ms']:.1f} ms | "
            f"{p['plaintext']['median_step_ms']:.1f} ms | {p['ratio']:.3f} | "
            f"{p['tls']['cpu_seconds_per_step']:.4f} | {p['plaintext']['cpu_seconds_per_step']:.4f} | "
            f"{p['cpu_ratio']:.3f} | {p['tls']['load_before'][0]} |"
        )
    r, c = jobs["ratio"], jobs["cpu_ratio"]
    client = "" if schedule == "sequential" else " (services only: one client process serves both jobs)"
    lines += [
        "",
        f"**Ratio TLS/plaintext of the median step time: median {r['median']:.3f} "
        f"(spread {r['min']:.3f}-{r['max']:.3f} over {len(jobs['pairs'])} pairs).** "
        f"CPU-seconds per step of all processes{client}: TLS {jobs['cpu_seconds_per_step']['tls']:.4f}, "
        f"plaintext {jobs['cpu_seconds_per_step']['plaintext']:.4f} (median of pairs); ratio median "
        f"{c['median']:.3f} (spread {c['min']:.3f}-{c['max']:.3f}). "
        f"Final losses of all runs: {', '.join(str(x) for x in jobs['final_losses'])}.",
        "",
        "CPU-seconds per step by process (median over pairs):",
        "",
        "| process | TLS | plaintext |",
        "|---|---|---|",
    ]
    by = jobs["cpu_seconds_per_step_by_process"]
    for name in sorted(by["tls"]):
        lines.append(f"| {name} | {by['tls'][name]:.4f} | {by['plaintext'].get(name, 0.0):.4f} |")
    return [*lines, ""]


def _micro_section(micro: dict[str, Any]) -> list[str]:
    t, p = micro["median"]["tls"], micro["median"]["plaintext"]
    return [
        "## Micro-benchmark: one unary and one streaming call on the internal TLS stack",
        "",
        f"{_env_line(micro['environment'])} Median of {len(micro['rounds']['tls'])} interleaved rounds; "
        f"{micro['calls_per_round']} unary calls of 256 B per round on a kept channel, a stream of "
        f"{micro['stream_mb_per_round']} x 1 MiB messages per round (client stream, as an edge sends "
        "activations). TLS = the services' own `ServerTls` (client certificate required) and "
        "`ClientTls`/`internal_channel`.",
        "",
        "| | TLS | plaintext | ratio |",
        "|---|---|---|---|",
        f"| unary latency, kept channel | {t['unary_median_us']:.0f} us | "
        f"{p['unary_median_us']:.0f} us | "
        f"{t['unary_median_us'] / p['unary_median_us']:.2f} |",
        f"| unary on a new channel (connect + handshake) | {t['unary_new_channel_median_ms']:.2f} ms | "
        f"{p['unary_new_channel_median_ms']:.2f} ms | "
        f"{t['unary_new_channel_median_ms'] / p['unary_new_channel_median_ms']:.2f} |",
        f"| stream throughput | {t['stream_mb_per_s']:.0f} MB/s | {p['stream_mb_per_s']:.0f} MB/s | "
        f"{t['stream_mb_per_s'] / p['stream_mb_per_s']:.2f} |",
        "| CPU-seconds per GB streamed (client + server, one process) | "
        f"{t['stream_cpu_seconds_per_gb']:.2f} | "
        f"{p['stream_cpu_seconds_per_gb']:.2f} | "
        f"{t['stream_cpu_seconds_per_gb'] / p['stream_cpu_seconds_per_gb']:.2f} |",
        "",
    ]


def markdown(out: Path) -> str:
    """The report from the newest result of each part in ``out`` (each part states its own run)."""
    lines = [
        "# What internal TLS costs (measured)",
        "",
        "Generated by `make bench-internal-tls` (`bench/security/internal_tls.py`; method in its "
        "docstring) from the JSON in `bench-results/internal-tls/`. Target: the demo's step "
        "time with internal TLS within 5 % of plaintext, i.e. a ratio <= 1.05.",
        "",
    ]
    for schedule in SCHEDULES:
        path = out / f"jobs-{schedule}.json"
        if path.is_file():
            lines += _jobs_section(json.loads(path.read_text()))
    if (out / "micro.json").is_file():
        lines += _micro_section(json.loads((out / "micro.json").read_text()))
    return "\n".join(lines)


def parse_cpus(text: str) -> set[int]:
    """A taskset-style core list: ``0,1`` or ``0-3`` or ``0,2-3``."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        try:
            cpus.update(range(int(first), int(last or first) + 1))
        except ValueError:
            raise SystemExit(f"--cpus {text!r}: expected a core list like 0,1 or 0-3") from None
    return cpus


def main() -> int:
    parser = argparse.ArgumentParser(description="Step time of the demo job with internal TLS vs plaintext.")
    parser.add_argument("--pairs", type=int, default=8, help="TLS/plaintext pairs per schedule (>= 6)")
    parser.add_argument("--schedule", choices=[*SCHEDULES, "both"], default="both")
    parser.add_argument("--steps", type=int, default=60, help="steps per job (the demo's 60)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps of each job not measured")
    parser.add_argument("--bandwidth-mbit", type=float, default=60.0)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--cpus", default="", help="cores to pin every process to, e.g. 0,1 (default: all)")
    parser.add_argument("--micro-rounds", type=int, default=6)
    parser.add_argument("--micro-calls", type=int, default=500)
    parser.add_argument("--micro-mb", type=int, default=64)
    parser.add_argument("--skip-jobs", action="store_true", help="only the micro-benchmark")
    parser.add_argument("--skip-micro", action="store_true", help="only the jobs")
    parser.add_argument("--out", type=Path, default=Path("bench-results/internal-tls"))
    parser.add_argument("--doc", type=Path, help="also write the markdown report here")
    args = parser.parse_args()
    if args.steps <= args.warmup + 2:
        parser.error("--steps must exceed --warmup by more than 2")
    cpus = parse_cpus(args.cpus) or os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)  # what `taskset -c` does; every service started below inherits it
    args.out.mkdir(parents=True, exist_ok=True)

    def environment() -> dict[str, Any]:
        return {
            "cpus": ",".join(str(c) for c in sorted(cpus)),
            "cpus_online": os.cpu_count(),
            "load_before": load(),
            "steps": args.steps,
            "warmup": args.warmup,
            "bandwidth_mbit": args.bandwidth_mbit,
            "delay_ms": args.delay_ms,
            "started_unix": time.time(),
        }

    with tempfile.TemporaryDirectory(prefix="nebula-bench-intls-") as tmp:
        if not args.skip_micro:
            env = environment()
            micro = micro_benchmark(args, Path(tmp))
            env["load_after"] = load()
            (args.out / "micro.json").write_text(json.dumps({"environment": env, **micro}, indent=2))
        if not args.skip_jobs:
            for schedule in SCHEDULES if args.schedule == "both" else (args.schedule,):
                env = environment()
                jobs = job_benchmark(args, Path(tmp), schedule)
                env["load_after"] = load()
                path = args.out / f"jobs-{schedule}.json"
                path.write_text(json.dumps({"environment": env, **jobs}, indent=2))
    report = markdown(args.out)
    (args.out / "internal-tls.md").write_text(report)
    if args.doc:
        args.doc.write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
