"""A stranger crowds the WAN port: does the genuine peer's job slow down, and what does it cost the switch?

The WAN port is open to the internet by design. This runs a ``nebula local up`` deployment with its
defaults (``LocalDeployment``, the WAN emulator at 60 Mbit/s and 20 ms each way) and, from another
address (127.0.0.2, a host on the internet), keeps ``--connections`` (1,000) connections at switch b's
WAN port: a quarter each idle, stalled after the raw link preamble, stalled after the first bytes of a
TLS record, and stalled after 64 random bytes. Each one the switch closes is opened again within a
second, so the crowd stands for the whole phase; it runs in a process of its own at nice 19, standing
for a host elsewhere (its CPU is not the switch's; what the switch spends on it is). Per round, side by
side: ``examples/digit_sum`` on a quiet port, then with the crowd (step times are the trainers' own,
``StageStatus.step_seconds``, steps after the second), and the genuine peer's mutual TLS handshake
(switch a's own certificate, as its link dials: median of ``HANDSHAKES``) quiet and in the crowd. Switch
b's open descriptors and RSS are sampled from ``/proc`` every 0.5 s, and its ``link.refused`` audit
records counted.

Usage: ``python bench/security/crowd.py [--out DIR] [--rounds N] [--steps N] [--connections N]``; writes
``crowd.json`` and ``crowd.md``. ``--quick`` (one round, fewer steps) fails when the job's step time in
the crowd exceeds 1.2x of quiet, the handshake 2x (+ 0.25 s), switch b's descriptors ``FD_BOUND`` or
its RSS ``RSS_BOUND_MIB``, or the link dropped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))

from common import JobFollower, ProcessSampler, load_info, md_table, write_json
from prometheus_client.parser import text_string_to_metric_families

from nebula_common.jobspec import load_spec
from nebula_common.launcher import LocalDeployment
from nebula_common.metrics import read_metrics
from nebula_common.pki import Identity
from nebula_common.pki.store import PkiLayout
from nebula_common.sdk.client import ClusterSession, submit_job
from nebula_common.sdk.jobs import ProgramJob
from services.switch.rawlink_connection import PREAMBLE
from services.switch.source_limits import MAX_PENDING
from tests.support.accounts import make_user

ROOT = Path(__file__).resolve().parents[2]
JOB_SPEC = ROOT / "examples" / "digit_sum" / "job.yaml"
STRANGER = "127.0.0.2"
BANDWIDTH_MBIT, DELAY_MS = 60.0, 20.0
HANDSHAKES = 9
TIMEOUT_S = 900.0
FD_BOUND = MAX_PENDING + 256
"""Switch b's descriptors: the WAN frontend's total of connections not yet through mutual TLS (512), each
relayed one holding two, is capped per source far below it; 256 for everything else the switch holds."""
RSS_BOUND_MIB = 400
"""Switch b's resident memory in the crowd (it runs at about 80 MiB on a quiet port)."""
TLS_START = b"\x16\x03\x01"
KINDS = ("idle", "preamble", "tls-start", "garbage")


class Crowd:
    """``size`` connections from ``STRANGER`` to ``port``, each re-opened as soon as the switch closes it."""

    def __init__(self, port: int, size: int) -> None:
        self.port, self.size = port, size
        self.opened = 0
        self.closed_by_switch = 0
        self.failed = 0
        self._sockets: list[socket.socket | None] = [None] * size
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Crowd:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        for sock in self._sockets:
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()

    def _open(self, index: int) -> socket.socket | None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(2)
        try:
            sock.bind((STRANGER, 0))
            sock.connect(("127.0.0.1", self.port))
            kind = KINDS[index % len(KINDS)]
            if kind == "preamble":
                sock.sendall(PREAMBLE)
            elif kind == "tls-start":
                sock.sendall(TLS_START)
            elif kind == "garbage":
                sock.sendall(os.urandom(64))
        except OSError:
            sock.close()
            self.failed += 1
            return None
        self.opened += 1
        return sock

    @staticmethod
    def _closed(sock: socket.socket) -> bool:
        poller = select.poll()  # descriptors above 1024: select() cannot take them
        poller.register(sock, select.POLLIN)
        if not poller.poll(0):
            return False
        try:
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _run(self) -> None:
        while not self._stop.is_set():
            for index, sock in enumerate(self._sockets):
                if self._stop.is_set():
                    return
                if sock is not None and self._closed(sock):
                    self.closed_by_switch += 1
                    sock.close()
                    sock = None
                if sock is None:
                    self._sockets[index] = self._open(index)
            self._stop.wait(1.0)


class LinkWatch:
    """Counts the samples (every 0.5 s) in which switch b's ``nebula_switch_link_up`` is not 1."""

    def __init__(self, deployment: LocalDeployment) -> None:
        self.deployment = deployment
        self.down = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LinkWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _up(self) -> bool:
        text = read_metrics(self.deployment.endpoints("b").metrics["switch-b"])
        return any(
            sample.name == "nebula_switch_link_up" and sample.value == 1
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        )

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                up = self._up()
            except Exception:
                up = False
            self.down += 0 if up else 1

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(10)
        return self.down


def crowd_process(port: int, size: int) -> None:
    """``--crowd PORT SIZE``: hold the crowd until stdin closes, then print its counts as JSON."""
    os.nice(19)
    with Crowd(port, size) as crowd:
        while crowd.opened < size // 2:
            time.sleep(0.1)
        print("standing", flush=True)
        sys.stdin.read()  # until the parent closes it
        counts = {"opened": crowd.opened, "closed": crowd.closed_by_switch}
    print(json.dumps(counts), flush=True)


class CrowdProcess:
    """The crowd in a child process (``crowd_process``): entered once it stands, its counts after exit."""

    def __init__(self, port: int, size: int) -> None:
        self.port, self.size = port, size
        self.counts: dict[str, int] = {}

    def __enter__(self) -> CrowdProcess:
        self.child = subprocess.Popen(
            [sys.executable, __file__, "--crowd", str(self.port), str(self.size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready: list[str] = []
        reader = threading.Thread(target=lambda: ready.append(self.child.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(120)
        if not ready or ready[0].strip() != "standing":
            self.child.kill()
            raise SystemExit(f"the crowd did not stand within 120 s (exit {self.child.poll()})")
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            out, _ = self.child.communicate("", timeout=60)
        except subprocess.TimeoutExpired:
            self.child.kill()
            raise SystemExit("the crowd did not stop within 60 s") from None
        self.counts = json.loads(out.strip().splitlines()[-1])


def genuine_context(pki: Path) -> ssl.SSLContext:
    """Switch a's mutual TLS client context (its own certificate and trust bundle), as its link dials."""
    paths = PkiLayout(pki, ["a", "b"]).cluster("a")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_verify_locations(cafile=str(paths.trust_bundle))
    context.load_cert_chain(str(paths.switch_cert), str(paths.switch_key))
    context.set_alpn_protocols(["h2"])  # as a gRPC channel: the frontend relays it to gRPC's WAN server
    return context


def handshake_seconds(port: int, context: ssl.SSLContext) -> float:
    """Median seconds to a completed mutual TLS handshake with switch b's WAN port, as switch a."""
    times = []
    for _ in range(HANDSHAKES):
        started = time.perf_counter()
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        with context.wrap_socket(sock, server_hostname=Identity("b", "switch").dns_name):
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def run_job(users: dict[str, ClusterSession], steps: int, label: str) -> float:
    """The digit_sum job's mean step (seconds, steps after the second); it must succeed."""
    spec = load_spec(JOB_SPEC, {"steps": steps, "checkpoint.interval": steps})
    handle = submit_job(ProgramJob(spec, f"crowd-{label}-{int(time.time() * 1000) % 10**8}"), users)
    follower = JobFollower(handle.job.job_id, handle.stages, give_up_s=TIMEOUT_S)
    if not follower.wait(TIMEOUT_S):
        raise SystemExit(f"the {label} job did not finish within {TIMEOUT_S:.0f} s")
    states = {o["state"] for o in follower.outcome().values()}
    if states != {"succeeded"}:
        raise SystemExit(f"the {label} job ended {states}: {follower.outcome()}")
    mean = follower.mean_reported_step_seconds("head")
    if not mean:
        raise SystemExit(f"the {label} job reported no step time")
    return mean


def refusal_records(run_dir: Path) -> list[dict[str, Any]]:
    """Switch b's ``link.refused`` audit records about the stranger."""
    found = []
    for path in sorted((run_dir / "b" / "switch").glob("audit.log*")):
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if record.get("event") == "link.refused" and record["details"].get("source") == STRANGER:
                    found.append(record)
    return found


def one_round(
    deployment: LocalDeployment, users: dict[str, ClusterSession], args: Any, k: int
) -> dict[str, Any]:
    port = int(deployment.cluster_state["b"].switch.info["wan_port"])  # type: ignore[union-attr]
    context = genuine_context(deployment.pki_dir)
    quiet_handshake = handshake_seconds(port, context)
    quiet_step = run_job(users, args.steps, f"quiet-{k}")
    sampler = ProcessSampler(deployment, ["switch-b"], 0.5).start()
    with CrowdProcess(port, args.connections) as crowd, LinkWatch(deployment) as link:
        crowd_handshake = handshake_seconds(port, context)
        crowd_step = run_job(users, args.steps, f"crowd-{k}")
        link_down_samples = link.stop()
    rows = sampler.stop()
    return {
        "quiet_step_s": round(quiet_step, 4),
        "crowd_step_s": round(crowd_step, 4),
        "step_ratio": round(crowd_step / quiet_step, 3),
        "quiet_handshake_s": round(quiet_handshake, 4),
        "crowd_handshake_s": round(crowd_handshake, 4),
        "handshake_ratio": round(crowd_handshake / quiet_handshake, 3),
        "crowd_opened": crowd.counts["opened"],
        "crowd_closed_by_switch": crowd.counts["closed"],
        "switch_b_max_fds": max(r["fds"] for r in rows),
        "switch_b_max_rss_mib": round(max(r["rss_kib"] for r in rows) / 1024, 1),
        "link_down_samples": link_down_samples,
        "refusal_records": len(refusal_records(deployment.run_dir)),
        "load": load_info(),
    }


def report(result: dict[str, Any]) -> str:
    header = [
        "round",
        "job step quiet ms",
        "in the crowd ms",
        "ratio",
        "handshake quiet ms",
        "in the crowd ms",
        "ratio",
        "switch b fds (max)",
        "switch b RSS MiB (max)",
        "crowd: opened / closed by the switch",
        "link down samples",
    ]
    rows = [
        [
            str(k + 1),
            f"{r['quiet_step_s'] * 1000:.0f}",
            f"{r['crowd_step_s'] * 1000:.0f}",
            f"{r['step_ratio']:.3f}",
            f"{r['quiet_handshake_s'] * 1000:.1f}",
            f"{r['crowd_handshake_s'] * 1000:.1f}",
            f"{r['handshake_ratio']:.2f}",
            str(r["switch_b_max_fds"]),
            f"{r['switch_b_max_rss_mib']:.0f}",
            f"{r['crowd_opened']:,} / {r['crowd_closed_by_switch']:,}",
            str(r["link_down_samples"]),
        ]
        for k, r in enumerate(result["rounds"])
    ]
    last = result["rounds"][-1]
    return (
        f"# A stranger's crowd at the WAN port\n\n"
        f"`{result['command']}` on a `nebula local up` deployment with its defaults (WAN {BANDWIDTH_MBIT:g} "
        f"Mbit/s, {DELAY_MS:g} ms each way), {result['connections']:,} connections from {STRANGER} held at "
        f"switch b's WAN port ({', '.join(KINDS)}; each re-opened when the switch closes it), run "
        f"{result['started']}. Job: `examples/digit_sum`, {result['steps']} steps, mean step after the "
        f"second; handshake: median of {HANDSHAKES} mutual TLS handshakes as switch a.\n\n"
        + md_table(header, rows)
        + f"\n\nMedians: step ratio **{result['median_step_ratio']:.3f}**, handshake ratio "
        f"**{result['median_handshake_ratio']:.2f}**; switch b at most {result['max_fds']} descriptors "
        f"(bound {FD_BOUND}) and {result['max_rss_mib']:.0f} MiB (bound {RSS_BOUND_MIB}); "
        f"{last['refusal_records']} `link.refused` records about the stranger in switch b's audit log.\n"
    )


def main() -> None:
    if sys.argv[1:2] == ["--crowd"]:
        crowd_process(int(sys.argv[2]), int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="one short round that fails on a broken bound")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 1, 20
    run_dir = args.out / "run-crowd"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    shape = {"bandwidth_mbit": BANDWIDTH_MBIT, "delay_ms": DELAY_MS}
    rounds = []
    with LocalDeployment(run_dir=run_dir, **shape) as deployment:  # type: ignore[arg-type]
        users = {c: make_user(deployment, c, "crowded") for c in ("a", "b")}
        for k in range(args.rounds):
            rounds.append(one_round(deployment, users, args, k))
            print(f"round {k + 1}: {json.dumps(rounds[-1])}", flush=True)
    result = {
        "command": "python bench/security/crowd.py " + " ".join(sys.argv[1:]),
        "started": started,
        "connections": args.connections,
        "steps": args.steps,
        "rounds": rounds,
        "median_step_ratio": statistics.median(r["step_ratio"] for r in rounds),
        "median_handshake_ratio": statistics.median(r["handshake_ratio"] for r in rounds),
        "max_fds": max(r["switch_b_max_fds"] for r in rounds),
        "max_rss_mib": max(r["switch_b_max_rss_mib"] for r in rounds),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "crowd.json", result)
    (args.out / "crowd.md").write_text(report(result))
    print(report(result))
    failures = []
    if result["median_step_ratio"] > 1.2:
        failures.append(f"step ratio {result['median_step_ratio']} (at most 1.2)")
    if any(r["crowd_handshake_s"] > 2 * r["quiet_handshake_s"] + 0.25 for r in rounds):
        failures.append("a handshake in the crowd took over 2x (+ 0.25 s) of quiet")
    if result["max_fds"] > FD_BOUND or result["max_rss_mib"] > RSS_BOUND_MIB:
        failures.append(f"switch b held {result['max_fds']} fds, {result['max_rss_mib']} MiB")
    if any(r["link_down_samples"] for r in rounds):
        failures.append("the link went down in the crowd")
    if any(r["crowd_closed_by_switch"] == 0 for r in rounds):
        failures.append("the switch closed none of the crowd's connections: did the crowd reach it?")
    if failures and args.quick:
        raise SystemExit("quick check failed: " + "; ".join(failures))
    for failure in failures:
        print(f"crowd: {failure}", file=sys.stderr)


if __name__ == "__main__":
    main()
