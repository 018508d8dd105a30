"""The WAN emulator against kernel shaping: same bandwidth, same bytes, side by side in one run.

An emulator that is optimistic makes every utilisation number measured through it a lie, so this
compares it with a shaper we did not write: ``tc tbf`` on a veth pair between two network namespaces
(``bench/wan/netns.py``). For each bandwidth, one-way delay and connection count, the same number of
bytes goes through both arms (``bench/wan/link_peer.py`` has the topology), alternating the order of
the arms on every repetition so drift in the machine's load hits both alike. Both arms use the same
token-bucket depth (``LinkShape.burst_bytes``) and the same queue (256 KiB).

Delay: ``tc netem`` is not available on these machines, so the kernel arm gets its delay from the
emulator's own code running as a delay-only proxy (bandwidth 1 Tbit/s). What is compared is therefore
the *shaping* (the part netem could not have checked anyway); the delay itself is checked
analytically: every arm's time is also reported against ``wire_bytes * 8 / rate + 2 * delay``.

Output: ``<out>/link.json``, ``<out>/link.md`` and ``<out>/link.png``. Run as root (namespaces);
without root or iproute2 the benchmark records why it was skipped and exits 0, so ``make bench-wan``
carries on.

    .venv/bin/python bench/wan/link.py --out bench-results/wan-link            # ~4 min
    .venv/bin/python bench/wan/link.py --out /tmp/wl --quick                   # ~1 min, noisier
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.wan.netns import ADDRESS_B, NetnsPair, unavailable_reason
from bench.wan.plots import PALETTE, grouped_bars
from nebula_common.wan import LinkShape
from nebula_common.wan.shape import QUEUE_BYTES

PEER = Path(__file__).resolve().parent / "link_peer.py"
TARGET = 0.03  # the bar: the emulator within 3% of tc tbf


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _wait_line(proc: subprocess.Popen[str], timeout_s: float, what: str) -> dict[str, Any]:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if line:
                return dict(json.loads(line))
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr else ""
            raise RuntimeError(f"{what} exited with {proc.returncode}: {err.strip()}")
    raise RuntimeError(f"{what} printed nothing within {timeout_s:.0f} s")


def _send(pair: NetnsPair, port: int, size: int, connections: int, timeout_s: float) -> float:
    argv = pair.exec_argv(
        pair.a,
        [sys.executable, str(PEER), "send", "--host", ADDRESS_B, "--port", str(port), "--bytes", str(size),
         "--connections", str(connections)],
    )  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"sender failed: {result.stderr.strip()}")
    return float(json.loads(result.stdout)["elapsed_s"])


def _ideal_s(shape: LinkShape, size: int, connections: int) -> float:
    per = [size // connections + (1 if i < size % connections else 0) for i in range(connections)]
    wire = sum(shape.wire_bytes(n) for n in per)
    return wire * 8 / shape.bits_per_second + 2 * shape.delay_s


def _start_peer(
    pair: NetnsPair, rate_mbit: float, delay_ms: float, tree: Path | None
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """A ``link_peer.py serve`` in namespace b; ``tree``: import ``nebula_common`` from that checkout."""
    argv = [sys.executable, str(PEER), "serve", "--listen-host", ADDRESS_B,
            "--bandwidth-mbit", str(rate_mbit), "--delay-ms", str(delay_ms)]  # fmt: skip
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    pipe = subprocess.PIPE
    peer = subprocess.Popen(
        pair.exec_argv(pair.b, argv), stdin=pipe, stdout=pipe, stderr=pipe, text=True, env=env
    )
    try:
        return peer, _wait_line(peer, 30, f"namespace peer ({tree or 'this tree'})")
    except BaseException:
        _stop_peer(peer)
        raise


def _stop_peer(peer: subprocess.Popen[str]) -> None:
    if peer.stdin is not None:
        peer.stdin.close()
    try:
        peer.wait(timeout=15)
    except subprocess.TimeoutExpired:
        peer.kill()
        peer.wait()


def measure_shape(
    pair: NetnsPair,
    rate_mbit: float,
    delay_ms: float,
    connections: list[int],
    reps: int,
    seconds: float,
    baseline: Path | None = None,
) -> list[dict[str, Any]]:
    shape = LinkShape(bandwidth_mbit=rate_mbit, delay_ms=delay_ms)
    size = int(shape.bits_per_second / 8 * seconds)
    peers: list[subprocess.Popen[str]] = []
    rows: list[dict[str, Any]] = []
    try:
        peer, ports = _start_peer(pair, rate_mbit, delay_ms, None)
        peers.append(peer)
        arm_ports = {"kernel": int(ports["reference"]), "emulator": int(ports["emulator"])}
        if baseline is not None:
            peer, base_ports = _start_peer(pair, rate_mbit, delay_ms, baseline)
            peers.append(peer)
            arm_ports["baseline"] = int(base_ports["emulator"])
        arms = list(arm_ports)
        tc_command = ""
        for conns in connections:
            times: dict[str, list[float]] = {arm: [] for arm in arms}
            for rep in range(reps):
                # Rotate the order every repetition so drift in the machine's load hits every arm alike.
                for arm in arms[rep % len(arms) :] + arms[: rep % len(arms)]:
                    if arm == "kernel":
                        tc_command = pair.shape(int(shape.bits_per_second), shape.burst_bytes, QUEUE_BYTES)
                    else:
                        pair.unshape()
                    times[arm].append(_send(pair, arm_ports[arm], size, conns, timeout_s=20 * seconds + 30))
                pair.unshape()
            ratios = [k / e for k, e in zip(times["kernel"], times["emulator"], strict=True)]
            ideal = _ideal_s(shape, size, conns)
            row = {
                "bandwidth_mbit": rate_mbit,
                "delay_ms": delay_ms,
                "connections": conns,
                "bytes": size,
                "kernel_s": times["kernel"],
                "emulator_s": times["emulator"],
                "ideal_s": ideal,
                # >1: the emulator moved the same bytes faster than the kernel (optimistic).
                "emulator_over_kernel": ratios,
                "median_ratio": statistics.median(ratios),
                "kernel_goodput_mbit": size * 8 / statistics.median(times["kernel"]) / 1e6,
                "emulator_goodput_mbit": size * 8 / statistics.median(times["emulator"]) / 1e6,
                "kernel_over_ideal": ideal / statistics.median(times["kernel"]),
                "emulator_over_ideal": ideal / statistics.median(times["emulator"]),
                "tc": tc_command,
            }
            row["within_target"] = abs(row["median_ratio"] - 1) <= TARGET
            line = (
                f"{rate_mbit:g} Mbit/s {delay_ms:g} ms x{conns}: emulator/tbf {row['median_ratio']:.3f} "
                f"(tbf {row['kernel_goodput_mbit']:.1f}, emulator {row['emulator_goodput_mbit']:.1f} "
                f"Mbit/s goodput; vs ideal tbf {row['kernel_over_ideal']:.3f}, "
                f"emulator {row['emulator_over_ideal']:.3f})"
            )
            if "baseline" in times:
                base = [k / b for k, b in zip(times["kernel"], times["baseline"], strict=True)]
                row["baseline_s"] = times["baseline"]
                row["baseline_over_kernel"] = base
                row["baseline_median_ratio"] = statistics.median(base)
                line += f"; baseline emulator/tbf {row['baseline_median_ratio']:.3f}"
            print(line, flush=True)
            rows.append(row)
    finally:
        for peer in peers:
            _stop_peer(peer)
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    groups: dict[tuple[float, float], list[float | None]] = {}
    for row in rows:
        groups.setdefault((row["bandwidth_mbit"], row["delay_ms"]), []).append(row["median_ratio"])
    guides = [(1.0, PALETTE["black"]), (1 - TARGET, PALETTE["red"]), (1 + TARGET, PALETTE["red"])]
    grouped_bars(path, list(groups.values()), y_min=0.9, y_max=1.1, guides=guides)


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# WAN emulator vs kernel shaping (`tc tbf`)",
        "",
        f"Command: `{result['command']}`  ",
        f"Load average before {result['load_before']}, after {result['load_after']} (2 cores, shared).",
        "",
    ]
    if result.get("skipped"):
        return "\n".join([*lines, f"**Skipped:** {result['skipped']}", ""])
    lines += [
        "Same bytes through `tc tbf` on a veth between two namespaces (plus a delay-only proxy) and through",
        "the emulator; ratio = emulator goodput / tbf goodput (>1: emulator optimistic), median of the",
        "alternating repetitions. *vs ideal* = (wire bytes x 8 / rate + 2 x delay) / measured time.",
        f"*baseline*: the emulator of `{result.get('baseline') or '(none given)'}` as a third arm of the"
        " same run.",
        "",
        "| Mbit/s | delay ms | conns | MB | tbf Mbit/s | emulator Mbit/s | emulator/tbf | within 3% "
        "| tbf vs ideal | emulator vs ideal | baseline emulator/tbf |",
        "|---:|---:|---:|---:|---:|---:|---:|:--:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        lines.append(
            "| "
            + " | ".join(
                [
                    f"{row['bandwidth_mbit']:g}",
                    f"{row['delay_ms']:g}",
                    str(row["connections"]),
                    f"{row['bytes'] / 1e6:.1f}",
                    f"{row['kernel_goodput_mbit']:.2f}",
                    f"{row['emulator_goodput_mbit']:.2f}",
                    f"{row['median_ratio']:.3f}",
                    "yes" if row["within_target"] else "NO",
                    f"{row['kernel_over_ideal']:.3f}",
                    f"{row['emulator_over_ideal']:.3f}",
                    f"{row['baseline_median_ratio']:.3f}" if "baseline_median_ratio" in row else "-",
                ]
            )
            + " |"
        )
    lines += [
        "",
        f"tc reference: `{result['rows'][-1]['tc'] if result['rows'] else ''}`",
        "",
        "![emulator/tbf](link.png)",
        "",
        "Figure: emulator/tbf per (bandwidth, delay) group in table order; blue 1 connection, orange 4;"
        " y from 0.90 to 1.10, black line 1.00, red lines the 3% bounds.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results/wan-link"))
    parser.add_argument("--quick", action="store_true", help="one repetition, shorter transfers")
    parser.add_argument("--bandwidths", default="60,200", help="Mbit/s, comma-separated")
    parser.add_argument("--delays", default="0,20", help="one-way ms, comma-separated")
    parser.add_argument("--connections", default="1,4", help="comma-separated")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.5, help="link time per transfer")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another Nebula checkout (e.g. /work/main) whose emulator runs as a third arm, for before/after",
    )
    args = parser.parse_args(argv)
    reps, seconds = (1, 1.0) if args.quick else (args.reps, args.seconds)
    result: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "load_before": _load(),
        "queue_bytes": QUEUE_BYTES,
        "baseline": str(args.baseline) if args.baseline else None,
        "rows": [],
    }
    reason = unavailable_reason()
    if reason is not None:
        result["skipped"] = reason
        print(f"bench-wan-link skipped: {reason}")
    else:
        with NetnsPair() as pair:
            for rate in [float(x) for x in args.bandwidths.split(",")]:
                for delay in [float(x) for x in args.delays.split(",")]:
                    result["rows"] += measure_shape(
                        pair,
                        rate,
                        delay,
                        [int(x) for x in args.connections.split(",")],
                        reps,
                        seconds,
                        args.baseline,
                    )
    result["load_after"] = _load()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "link.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "link.md").write_text(markdown(result))
    if result["rows"]:
        plot(result["rows"], args.out / "link.png")
    print(f"wrote {args.out / 'link.json'} and {args.out / 'link.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
