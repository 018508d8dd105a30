"""Three clusters in containers, for real: docker/compose-3clusters.yml up, a 3-stage chain job, down -v.

    PYTHONPATH=$PWD .venv/bin/python docker/smoke_three_clusters.py [--steps 6] [--project nebula3]
    make smoke-three-clusters-containers        (in .ci/run after smoke-ranks-containers)

Brings up ``docker/compose-3clusters.yml`` (a, b, c; every pair of switches linked through a WAN
emulator), then checks, failing with the first thing that is not as expected:

1. every service is healthy and each switch reports its links to both other clusters up;
2. the chain job ``examples/chain`` (reader in a, mixer in b, head in c) with codec ``none`` on both
   edges succeeds, every stage SUCCEEDED;
3. every edge of it opened as records on its switch's edge socket (each switch's audit log:
   ``edge.open`` with ``transport: records``), the carrier compose gives its stages;
4. its per-step losses equal the unsplit model's (``run_unsplit``, the same seed) within 1e-5.

Keeps the image (``--image``, default ``localhost/nebula:dev``) fresh with a cached
``podman-compose build`` of docker-compose.yml (nothing new when the sources did not change;
``--no-build`` skips it). ``--port-offset`` moves every published port (by a generated override file).
``down -v`` runs always, also on failure; ``--keep`` leaves it up. Prints one JSON summary with phase
timings; on failure each container's last log lines first.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from compose_support import (
    ROOT,
    Compose,
    SmokeFailure,
    Timings,
    add_arguments,
    check,
    check_edge_transports,
    logs,
    run_smoke,
    wait,
)
from smoke import create_user, endpoints, wait_link  # docker/smoke.py (this script's directory)

from nebula_common.jobspec import load_spec
from nebula_common.jobspec.reference import run_unsplit
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.client import submit_job
from nebula_common.sdk.jobs import ProgramJob

FILE = ("docker/compose-3clusters.yml",)
CLUSTERS = ("a", "b", "c")
EXAMPLE = ROOT / "examples" / "chain" / "job.yaml"
HEALTH_TIMEOUT_S = 480.0
LINK_TIMEOUT_S = 120.0
TOLERANCE = 1e-5


def ports(cluster: str, offset: int) -> str:
    """switch, trainer, auth, metrics as published by compose-3clusters.yml (41400.. for a, 42400.. b)."""
    base = 40000 + 1000 * (CLUSTERS.index(cluster) + 1)
    return ",".join(str(base + p + offset) for p in (400, 500, 600, 100))


def run(args: argparse.Namespace, compose: Compose, timings: Timings) -> dict[str, Any]:
    lap = timings.lap
    compose("up", "-d", timeout=args.up_timeout)
    lap("up -d")
    names = compose.wait_healthy(timeout=HEALTH_TIMEOUT_S)
    lap(f"every service healthy ({len(names) - 1} containers)")

    cas = Path(tempfile.mkdtemp(prefix="smoke-3c-ca-"))
    sessions = {}
    for cluster, (password, ca) in compose.admin_secrets(CLUSTERS, cas).items():
        sessions[cluster] = create_user(
            endpoints(cluster, ports(cluster, args.port_offset), ca),
            password,
            f"smoke-{cluster}-{os.getpid()}",
        )
    link_wait = wait_link(list(sessions.values()), 120.0)
    # Each switch's every link (a-b, a-c and b-c), not only its first one.
    links: dict[str, dict[str, str]] = {}

    def every_link_up() -> bool:
        for cluster, session in sessions.items():
            statuses = session.link_statuses()
            links[cluster] = {p: s.link_role if s.connected else "down" for p, s in statuses.items()}
        return all(sorted(links[c]) == [p for p in CLUSTERS if p != c] for c in CLUSTERS) and all(
            "down" not in roles.values() for roles in links.values()
        )

    try:
        wait(every_link_up, LINK_TIMEOUT_S, "every switch's links to both other clusters to be up")
    except SmokeFailure as exc:
        raise SmokeFailure(f"{exc}; the links: {links}") from None
    for cluster in CLUSTERS:
        text = logs(names[f"switch-{cluster}"])
        check(
            text.count("WAN link up") >= 2,
            f"switch-{cluster} logged fewer than 2 'WAN link up':\n{text[-800:]}",
        )
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
    expected = {f"switch-{c}": "records" for c in CLUSTERS}
    transports = check_edge_transports(compose.exec_in, expected, job.job_id)
    lap("edges as records on each switch's edge socket")
    reference = run_unsplit(job.loaded)
    check(sorted(losses) == list(range(args.steps)), f"losses for steps {sorted(losses)}")
    worst = max(abs(losses[s] - reference.losses[s]) for s in range(args.steps))
    check(
        worst <= TOLERANCE,
        f"the chain's losses differ from the unsplit model's by {worst:.2e} (> {TOLERANCE:.0e})",
    )
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
        "links": links,
        "edge_transports": transports,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description="Three clusters in containers train a 3-stage chain job.")
    parser.add_argument("--steps", type=int, default=6)
    add_arguments(parser, project="nebula3", up_timeout=1800.0)
    args = parser.parse_args()
    return run_smoke("smoke-three-clusters", args, FILE, lambda compose, timings: run(args, compose, timings))


if __name__ == "__main__":
    sys.exit(main())
