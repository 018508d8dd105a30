"""Three clusters in containers, for real: docker/compose-3clusters.yml up, a 3-stage chain job, down -v.

    PYTHONPATH=$PWD .venv/bin/python docker/smoke_three_clusters.py [--steps 6] [--project nebula3]

NOT YET RUN (2026-11-26): written for issue 12, but the shared machine (load 30-47) left no time to
bring the 3-cluster compose up; no Makefile target until it has passed once.

Brings up ``docker/compose-3clusters.yml`` (a, b, c; every pair of switches linked through a WAN
emulator), then checks, failing with the first thing that is not as expected:

1. every service is healthy and each cluster's switch reports its WAN link(s) up;
2. the chain job ``examples/chain`` (reader in a, mixer in b, head in c) with codec ``none`` on both
   edges succeeds, every stage SUCCEEDED;
3. its per-step losses equal the unsplit model's (``run_unsplit``, the same seed) within 1e-5.

Reuses the image (``--image``, default ``localhost/nebula:dev``, built by ``podman-compose build`` of
docker-compose.yml; built here only when missing). ``--port-offset`` moves every published port (by a
generated override file). Prints one JSON summary with phase timings; ``--keep`` leaves it up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from smoke import create_user, endpoints, wait_link  # docker/smoke.py (this script's directory)
from smoke_ranks import DEFAULT_IMAGE, ROOT, Compose, SmokeFailure, check, healthy, logs, override_file, wait

from nebula_common.jobspec import load_spec
from nebula_common.jobspec.reference import run_unsplit
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.client import submit_job
from nebula_common.sdk.jobs import ProgramJob

FILE = ("docker/compose-3clusters.yml",)
CLUSTERS = ("a", "b", "c")
EXAMPLE = ROOT / "examples" / "chain" / "job.yaml"
HEALTH_TIMEOUT_S = 480.0


def log(message: str) -> None:
    print(f"smoke-three-clusters: {message}", file=sys.stderr, flush=True)


def ports(cluster: str, offset: int) -> str:
    """switch, trainer, auth, metrics as published by compose-3clusters.yml (41400.. for a, 42400.. b)."""
    base = 40000 + 1000 * (CLUSTERS.index(cluster) + 1)
    return ",".join(str(base + p + offset) for p in (400, 500, 600, 100))


def run(args: argparse.Namespace, compose: Compose, lap: Any) -> dict[str, Any]:
    compose("up", "-d", timeout=args.up_timeout)
    lap("up -d")
    names = compose.containers()
    checked = [n for s, n in names.items() if s != "pki-init"]
    wait(lambda: all(healthy(n) for n in checked), HEALTH_TIMEOUT_S, "every service to be healthy")
    lap(f"every service healthy ({len(checked)} containers)")

    cas = Path(tempfile.mkdtemp(prefix="smoke-3c-ca-"))
    sessions = {}
    for cluster in CLUSTERS:
        password = compose("exec", "-T", f"auth-{cluster}", "cat", "/etc/nebula/admin/admin-password").strip()
        ca = cas / f"{cluster}-ca.crt"
        ca.write_text(compose("exec", "-T", f"auth-{cluster}", "cat", "/etc/nebula/internal-tls/ca.crt"))
        sessions[cluster] = create_user(
            endpoints(cluster, ports(cluster, args.port_offset), ca),
            password,
            f"smoke-{cluster}-{os.getpid()}",
        )
    link_wait = wait_link(list(sessions.values()), 120.0)
    for cluster in CLUSTERS:
        text = logs(names[f"switch-{cluster}"])
        check("WAN link up" in text, f"switch-{cluster} logged no 'WAN link up':\n{text[-800:]}")
    lap("users and links")

    overrides: dict[str, object] = {"steps": args.steps, "checkpoint.interval": 2}
    for edge in (0, 1):
        overrides[f"edges.{edge}.codec.forward"] = "none"
        overrides[f"edges.{edge}.codec.backward"] = "none"
    job = ProgramJob(load_spec(EXAMPLE, overrides))
    handle = submit_job(job, sessions)
    losses: dict[int, float] = {}
    for update in handle.updates():
        if update.status.stage == "head" and update.status.HasField("loss"):
            losses[int(update.status.steps_done) - 1] = update.status.loss
    states = {stage: trainer_pb2.StageState.Name(s.state) for stage, s in handle.final.items()}
    check(
        set(states.values()) == {"STAGE_STATE_SUCCEEDED"} and len(states) == 3,
        f"the chain job did not succeed: {states}; {[s.message for s in handle.final.values()]}",
    )
    lap(f"chain job ({args.steps} steps)")
    reference = run_unsplit(job.loaded)
    check(sorted(losses) == list(range(args.steps)), f"losses for steps {sorted(losses)}")
    worst = max(abs(losses[s] - reference.losses[s]) for s in range(args.steps))
    check(worst <= 1e-5, f"the chain's losses differ from the unsplit model's by {worst:.2e} (> 1e-5)")
    lap("unsplit reference")
    for session in sessions.values():
        session.close()
    return {
        "job_id": job.job_id,
        "stage_states": states,
        "stage_clusters": job.clusters(),
        "losses": [round(losses[s], 5) for s in range(args.steps)],
        "max_abs_diff_to_unsplit": worst,
        "link_wait_seconds": round(link_wait, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description="Three clusters in containers train a 3-stage chain job.")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--project", default="nebula3", help="compose project name")
    parser.add_argument("--image", default=DEFAULT_IMAGE)
    parser.add_argument("--port-offset", type=int, default=0, help="move every published port by this")
    parser.add_argument("--keep", action="store_true", help="leave the deployment up")
    parser.add_argument("--up-timeout", type=float, default=1800.0, help="seconds for `up -d`")
    args = parser.parse_args()
    started = phase = time.monotonic()
    timings: dict[str, float] = {}

    def lap(name: str) -> None:
        nonlocal phase
        timings[name] = round(time.monotonic() - phase, 1)
        log(f"{name}: {timings[name]} s (total {time.monotonic() - started:.0f} s)")
        phase = time.monotonic()

    with tempfile.TemporaryDirectory(prefix="smoke-3c-") as tmp:
        extra = override_file(Path(tmp), args.image, args.port_offset, FILE)
        compose = Compose(args.project, extra, FILE)
        result: dict[str, Any] = {}
        status = 0
        try:
            if subprocess.run(["podman", "image", "exists", args.image], timeout=60).returncode != 0:
                Compose(args.project, None, ("docker-compose.yml",))("build", timeout=1800)
                lap("build")
            result = run(args, compose, lap)
        except (SmokeFailure, subprocess.TimeoutExpired) as exc:
            log(f"FAILED: {exc}")
            for service, name in sorted(compose.containers().items()):
                tail = logs(name).strip().splitlines()[-4:]
                log(f"--- {service} ({name})\n" + "\n".join(tail))
            status = 1
        finally:
            if not args.keep:
                phase = time.monotonic()
                subprocess.run([*compose.base, "down", "-v"], capture_output=True, timeout=900, cwd=ROOT)
                lap("down -v")
    result["timings_s"] = timings
    result["total_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(result, indent=2))
    return status


if __name__ == "__main__":
    sys.exit(main())
