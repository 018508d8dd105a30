"""How long the `nebula` CLI takes to answer, as a user types it (issue: "a CLI that answers at once").

    make bench-cli                    # = python bench/cli/startup.py --out bench-results/cli

Starts a `nebula local up` deployment of its own (in a temporary run directory), submits the
``examples/digit_sum`` job so ``job list`` and ``job status`` have a record to render, then runs each
command below ``--runs`` times in a fresh process (the installed ``nebula`` script) and reports the
median wall time and peak memory. Exits 1 naming every command whose median is above ``--bound``
(0.5 s: what `kubectl` and `flwr` take for the same questions).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NEBULA = str(Path(sys.executable).parent / "nebula")


def timed(args: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (KiB) of one fresh `nebula` process (its own rusage, from wait4)."""
    with tempfile.TemporaryFile() as errors:
        started = time.perf_counter()
        process = subprocess.Popen([NEBULA, *args], stdout=subprocess.DEVNULL, stderr=errors)
        _, status, usage = os.wait4(process.pid, 0)
        elapsed = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            errors.seek(0)
            said = errors.read().decode(errors="replace")[-800:]
            raise SystemExit(f"bench-cli: `nebula {' '.join(args)}` exited {process.returncode}: {said}")
    return elapsed, usage.ru_maxrss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--bound", type=float, default=0.5, help="Largest acceptable median (s).")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "cli")
    args = parser.parse_args()
    from nebula_common.launcher import LocalDeployment

    with (
        tempfile.TemporaryDirectory(prefix="bench-cli-") as tmp,
        LocalDeployment(run_dir=Path(tmp)) as deployment,
    ):
        run_dir = deployment.run_dir
        deployment.write_description(run_dir / "deployment.json")
        subprocess.run(
            [NEBULA, "job", "submit", str(ROOT / "examples" / "digit_sum" / "job.yaml"),
             "--deployment", str(run_dir / "deployment.json"), "--new-account"],
            check=True, capture_output=True, timeout=600,
        )  # fmt: skip
        listed = subprocess.run(
            [NEBULA, "job", "list", "--deployment", str(run_dir), "-o", "name"],
            check=True, capture_output=True, text=True, timeout=60,
        ).stdout.split()  # fmt: skip
        commands = {
            "nebula --help": ["--help"],
            "nebula job list": ["job", "list", "--deployment", str(run_dir)],
            "nebula job status": ["job", "status", listed[0], "--deployment", str(run_dir)],
            "nebula pki --help": ["pki", "--help"],
            "nebula local status": ["local", "status", "--run-dir", str(run_dir)],
            "nebula account --help": ["account", "--help"],
        }
        results = {}
        for name, command in commands.items():
            runs = [timed(command) for _ in range(args.runs)]
            results[name] = {
                "median_s": round(statistics.median(t for t, _ in runs), 3),
                "runs_s": [round(t, 3) for t, _ in runs],
                "peak_rss_mib": round(max(m for _, m in runs) / 1024, 1),
            }
    slow = [name for name, r in results.items() if r["median_s"] > args.bound]
    report = {"bound_s": args.bound, "runs": args.runs, "commands": results, "over_bound": slow}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "startup.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    for name in slow:
        print(
            f"bench-cli: {name} took {results[name]['median_s']} s (median), above {args.bound} s",
            file=sys.stderr,
        )
    return 1 if slow else 0


if __name__ == "__main__":
    sys.exit(main())
