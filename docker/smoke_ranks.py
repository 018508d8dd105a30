"""Cluster a's stage on two rank containers, for real: compose up, the numbers job, down -v.

    PYTHONPATH=$PWD .venv/bin/python docker/smoke_ranks.py [--steps 10] [--project nebula-ranks]
    make smoke-ranks-containers

Brings up ``docker-compose.yml`` with ``docker-compose.ranks.yml`` (trainer-a hosts a rank store;
two worker containers, ``trainer-a-rank-0`` and ``-1``, form one gloo group by c10d rendezvous and
join it), then checks, failing with the first thing that is not as expected:

1. every service is healthy and both worker containers joined trainer-a's rank store, each from
   its own container (the workers' log lines name their rank and group);
2. the numbers job (docker/smoke.py: encoder in a, decoder in b) succeeds, each stage's edge as records
   on its switch's edge socket (the encoder's from its stage box too, though it computes on the ranks);
3. the encoder stage ran on the two ranks: trainer-a's "program stage running" record says
   ``ranks: 2`` and names the two worker containers' hosts, and each worker joined that stage's
   command group;
4. docker/smoke_hostile.py's stage written to break out, of an account trainer-a puts on its ranks
   (``NEBULA_RANKS_ACCOUNTS`` names docker/smoke.py's ``smoke-a-*`` and the attacker's ``mallory-*``):
   its driver runs in a Landlock box in trainer-a, where every attempt fails, and its ``stage.start``
   audit record says so, as the numbers job's does; its victim's account, not named, computes in
   trainer-a's box alone.

Keeps the image (``--image``, default ``localhost/nebula:dev``) fresh with a cached
``podman-compose build`` (nothing new when the sources did not change; ``--no-build`` skips it).
``--port-offset N`` moves every published port by N (through a generated override file), so it
can run beside another compose deployment of this repo; ``--image`` points every service at another
tag the same way. Prints one JSON summary with the
phase timings; ``--keep`` leaves the deployment up. Needs podman + podman-compose and the host venv.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import smoke_hostile
from compose_support import ROOT, Compose, Timings, add_arguments, check, logs, run_smoke, wait

FILES = ("docker-compose.yml", "docker-compose.ranks.yml")
NAMED = "smoke-a-*,mallory-*"
"""The accounts trainer-a puts on its ranks (NEBULA_RANKS_ACCOUNTS): docker/smoke.py's in cluster a and
docker/smoke_hostile.py's attacker; its victim computes in trainer-a's box alone."""
AUDIT = "/var/lib/nebula/trainer/audit.log"
RANKS = ("trainer-a-rank-0", "trainer-a-rank-1")
BOXED = re.compile(r"stages run in a weaker box than bubblewrap's \(.*\): (landlock \(ABI \d+\)[^;]*)")
"""A worker's start-up line naming the box its stages get (``rank_box``)."""
HEALTH_TIMEOUT_S = 300.0
JOIN_TIMEOUT_S = 180.0
# switch internal, trainer, auth, switch metrics (docker/smoke.py's --host-ports-*)
PORTS = {"a": (17400, 17500, 17600, 19100), "b": (27400, 27500, 27600, 29100)}


def stage_records(trainer_log: str, job_id: str) -> list[dict[str, Any]]:
    """trainer-a's JSON "program stage running" records of ``job_id``."""
    found = []
    for line in trainer_log.splitlines():
        if line.startswith("{") and "program stage running" in line:
            record = json.loads(line)
            if record.get("message") == "program stage running" and record.get("job_id") == job_id:
                found.append(record)
    return found


def run(args: argparse.Namespace, compose: Compose, timings: Timings) -> dict[str, Any]:
    lap = timings.lap
    compose("up", "-d", timeout=args.up_timeout)  # podman-compose starts the containers one by one
    lap("up -d")
    names = compose.containers()
    missing = [s for s in RANKS if s not in names]
    check(not missing, f"the worker containers {missing} were not created (services: {sorted(names)})")
    compose.wait_healthy(skip=RANKS, timeout=HEALTH_TIMEOUT_S)  # the workers serve no gRPC
    lap("every service healthy")
    joined = re.compile(r"rank (\d) of 2 joined the trainer's rank store")
    group = re.compile(r"rank (\d) of 2: (\w+) group on (\w+)")
    wait(
        lambda: all(joined.search(logs(names[s])) for s in RANKS),
        JOIN_TIMEOUT_S,
        "both worker containers to join trainer-a's rank store",
    )
    workers = {}
    for rank, service in enumerate(RANKS):
        text = logs(names[service])
        check(joined.search(text).group(1) == str(rank), f"{service} joined as another rank:\n{text[-800:]}")  # type: ignore[union-attr]
        found = group.search(text)
        check(found is not None, f"{service} logged no group:\n{text[-800:]}")
        workers[service] = {"rank": rank, "backend": found.group(2), "device": found.group(3)}  # type: ignore[union-attr]
        # A container cannot make bubblewrap's namespaces: each worker boxes its stages with Landlock.
        boxed = BOXED.search(text)
        check(boxed is not None, f"{service} did not say how it boxes its stages:\n{text[-800:]}")
        workers[service]["box"] = boxed.group(1)  # type: ignore[union-attr]
    lap("both workers joined")

    # A stranger inside cluster a's network (the data service's container: no worker certificate)
    # gets nothing from trainer-a's rank store: a plain TCP client that speaks first, as TCPStore's does.
    # Only a TLS alert may come back; the probe prints what happened so a failure names it.
    probe = (
        "import socket, time\n"
        "deadline = time.monotonic() + 60\n"
        "while True:\n"
        "    try:\n"
        "        s = socket.create_connection(('trainer-a', 7510), timeout=30)\n"
        "        break\n"
        "    except OSError as exc:\n"  # the network's DNS may lag behind a new container
        "        if time.monotonic() > deadline:\n"
        "            raise\n"
        "        print('retrying:', exc, flush=True)\n"
        "        time.sleep(1)\n"
        "print('connected', flush=True)\n"
        "s.sendall(bytes(64))\n"
        "data = b''\n"
        "try:\n"
        "    while chunk := s.recv(4096):\n"
        "        data += chunk\n"
        "except ConnectionResetError:\n"
        "    pass\n"
        "print('received', len(data), data[:32].hex(), flush=True)\n"
    )
    stranger = subprocess.run(
        ["podman", "exec", names["data-a"], "python", "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = f"exit {stranger.returncode}: {stranger.stdout[-400:]} {stranger.stderr[-800:]}"
    ran = stranger.returncode == 0 and "connected" in stranger.stdout
    check(ran, f"the stranger's probe did not run: {said}")
    got = re.search(r"received (\d+) (\w*)", stranger.stdout)
    check(got is not None, f"the stranger's probe printed no result: {said}")
    nothing = got.group(1) == "0" or got.group(2).startswith("15")  # type: ignore[union-attr]  # 0x15: TLS alert
    check(nothing, f"trainer-a's rank store answered a plain client: {said}")
    wait(
        lambda: "rank store refused a connection" in logs(names["trainer-a"]),
        60,
        "trainer-a to log the stranger's refusal",
    )
    lap("a stranger refused by the rank store")

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cas = Path(tempfile.mkdtemp(prefix="smoke-ranks-ca-"))
    secrets = compose.admin_secrets("ab", cas)
    for cluster, (password, _) in secrets.items():
        env[f"NEBULA_ADMIN_PASSWORD_{cluster.upper()}"] = password
    ports = {c: ",".join(str(p + args.port_offset) for p in PORTS[c]) for c in "ab"}
    smoke = subprocess.run(
        [sys.executable, str(ROOT / "docker" / "smoke.py"), "--steps", str(args.steps),
         "--ca-a", str(cas / "a-ca.crt"), "--ca-b", str(cas / "b-ca.crt"),
         "--host-ports-a", ports["a"], "--host-ports-b", ports["b"],
         "--edge-transports", "switch-a=records,switch-b=records",
         "--audit-exec", shlex.join([*compose.base, "exec", "-T"])],
        capture_output=True, text=True, timeout=900, env=env, cwd=ROOT,
    )  # fmt: skip
    sys.stderr.write(smoke.stderr)
    check(smoke.returncode == 0, f"docker/smoke.py exited {smoke.returncode}: {smoke.stdout[-1500:]}")
    summary = json.loads(smoke.stdout)
    check(summary["succeeded"], f"the job did not succeed: {summary['stage_messages']}")
    lap(f"numbers job ({args.steps} steps)")

    records = stage_records(logs(names["trainer-a"]), summary["job_id"])
    check(records, f"trainer-a logged no 'program stage running' for {summary['job_id']}")
    record = records[-1]
    check(record.get("ranks") == 2, f"the encoder stage did not run on 2 ranks: {record}")
    hosts = record.get("rank_hosts", [])
    check(len(set(hosts)) == 2, f"the encoder stage's ranks are not two containers: {hosts}")
    for service in RANKS:
        text = logs(names[service])
        check("posted; joining its command group" in text, f"{service} never joined a stage:\n{text[-800:]}")
    lap("the numbers job's stage on both ranks")

    # A stage written to break out, of an account named for the ranks: its driver runs in trainer-a's
    # Landlock box, and every attempt of docker/smoke_hostile.py must fail there.
    hostile = smoke_hostile.run(
        compose,
        cas={c: ca for c, (_, ca) in secrets.items()},
        passwords={c: password for c, (password, _) in secrets.items()},
        ports=ports,
    )
    starts = {
        r["job_id"]: r["details"]["placement"]
        for r in map(json.loads, filter(None, compose("exec", "-T", "trainer-a", "cat", AUDIT).splitlines()))
        if r.get("event") == "stage.start"
    }
    on_ranks = "the cluster's 2 ranks, each rank's part boxed, driven from a landlock box on this trainer"
    for job_id, whose in ((summary["job_id"], "the numbers job"), (hostile["job_id"], "the hostile stage")):
        placement = starts.get(job_id, "")
        check(placement.startswith(on_ranks), f"{whose}'s stage.start names no boxed driver: {placement!r}")
    boxed = starts.get(hostile["victim_job_id"], "")
    check(
        boxed.startswith("landlock box") and "NEBULA_TRAINER_RANKS_ACCOUNTS" in boxed,
        f"the unnamed account's stage was not kept in trainer-a's box: {boxed!r}",
    )
    lap("a hostile stage on the ranks, its driver boxed; an unnamed account's off them")
    return {
        "job_id": summary["job_id"],
        "succeeded": summary["succeeded"],
        "steps": summary["steps"],
        "losses": [round(x, 4) for x in summary["loss_per_step"]],
        "encoder_stage": {"ranks": record["ranks"], "rank_hosts": hosts},
        "workers": workers,
        "edge_transports": summary["edge_transports"],
        "hostile_stage": {
            "placement": starts.get(hostile["job_id"], ""),
            "attempts_refused": hostile["attempts_refused"],
            "forged_edge_ticket": hostile["forged_edge_ticket"],
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description="Cluster a's stage on two rank containers, for real.")
    parser.add_argument("--steps", type=int, default=10)
    add_arguments(parser, project="nebula-ranks", up_timeout=1200.0)  # `up -d`: ~3 min on a quiet machine
    args = parser.parse_args()
    os.environ["NEBULA_RANKS_ACCOUNTS"] = NAMED  # compose interpolates it into trainer-a's settings
    return run_smoke("smoke-ranks", args, FILES, lambda compose, timings: run(args, compose, timings))


if __name__ == "__main__":
    sys.exit(main())
