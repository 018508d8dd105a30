"""What the stage box costs a user: `nebula demo` on this tree against a baseline tree, side by side.

Each round runs the product's own `nebula demo` (two clusters on this machine, the numbers job, the
defaults a new user gets) once per tree, alternating, so both see the same machine. Reported per tree:
the median over rounds of the mean step time (the first step, which includes warm-up, left out) and of
the start overhead (training wall time minus the sum of step times: from submission to the first step
and from the last step to the end). The baseline tree is any checkout of Nebula, e.g.
``git worktree add /tmp/nebula-baseline <commit>``; it runs with this tree's virtual environment and
this tree's WAN emulator (``EMULATOR``, copied over it): the emulator has since stopped lending an idle
link a free burst, so the baseline's own would time a cheaper link, not the stage box.

    python bench/security/stage_isolation.py --baseline /tmp/nebula-baseline --rounds 5

Writes ``bench-results/stage-isolation.json``.
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

HERE = Path(__file__).resolve().parents[2]
EMULATOR = ("nebula_common/wan/shape.py", "nebula_common/wan/shaper.py")
"""The WAN emulator's link model: both trees pay the same link."""


def run_demo(tree: Path, steps: int) -> dict[str, float]:
    """One `nebula demo` from ``tree`` (its code first on the path); the numbers of its summary."""
    with tempfile.TemporaryDirectory(prefix="nebula-bench-") as scratch:
        summary = Path(scratch) / "summary.json"
        env = {**os.environ, "PYTHONPATH": str(tree)}
        command = [sys.executable, "-m", "nebula_common.cli.app", "demo", "--steps", str(steps)]
        command += ["--run-dir", str(Path(scratch) / "run"), "--json", str(summary)]
        # One job, the same on both trees: codec none on the 60 Mbit/s, 20 ms link the demo ran before
        # it compared none with auto on a slower one.
        command += ["--codec-forward", "none", "--codec-backward", "none", "--bandwidth-mbit", "60"]
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(
                f"demo in {tree} failed ({done.returncode}): {done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
        result = json.loads(summary.read_text())
    steps_s = result["step_seconds_per_step"]
    return {
        "mean_step_s": statistics.fmean(steps_s[1:]),
        "start_overhead_s": result["train_wall_seconds"] - sum(steps_s),
        "final_loss": result["final_loss"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout of Nebula to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    if not (args.baseline / "services" / "trainer").is_dir():
        parser.error(f"--baseline {args.baseline}: not a Nebula checkout (no services/trainer)")
    trees = {"this": HERE, "baseline": args.baseline.resolve()}
    for name in EMULATOR:
        (trees["baseline"] / name).write_bytes((HERE / name).read_bytes())
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for number in range(args.rounds):
        order = list(trees) if number % 2 == 0 else list(reversed(trees))
        for name in order:
            rounds[name].append(run_demo(trees[name], args.steps))
            print(f"round {number + 1} {name}: {rounds[name][-1]}", flush=True)
    report: dict[str, object] = {"rounds": rounds, "load_after": os.getloadavg(), "at": time.time()}
    for name, runs in rounds.items():
        report[name] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    this: dict[str, float] = report["this"]  # type: ignore[assignment]
    base: dict[str, float] = report["baseline"]  # type: ignore[assignment]
    ratio = this["mean_step_s"] / base["mean_step_s"]
    delta = this["start_overhead_s"] - base["start_overhead_s"]
    report.update(step_ratio=ratio, start_overhead_delta_s=delta)
    out = HERE / "bench-results" / "stage-isolation.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    step_ms, base_ms = this["mean_step_s"] * 1e3, base["mean_step_s"] * 1e3
    print(f"median mean step: this {step_ms:.1f} ms, baseline {base_ms:.1f} ms (ratio {ratio:.3f})")
    print(f"start overhead: {delta:+.2f} s against the baseline; {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
