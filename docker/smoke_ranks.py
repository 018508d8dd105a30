"""Cluster a's stage on two rank containers, for real: compose up, the numbers job, down -v.

    PYTHONPATH=$PWD .venv/bin/python docker/smoke_ranks.py [--steps 10] [--project nebula-ranks]
    make smoke-ranks-containers

Brings up ``docker-compose.yml`` with ``docker-compose.ranks.yml`` (trainer-a hosts a rank store;
two worker containers, ``trainer-a-rank-0`` and ``-1``, form one gloo group by c10d rendezvous and
join it), then checks, failing with the first thing that is not as expected:

1. every service is healthy and both worker containers joined trainer-a's rank store, each from
   its own container (the workers' log lines name their rank and group);
2. the numbers job (docker/smoke.py: encoder in a, decoder in b) succeeds;
3. the encoder stage ran on the two ranks: trainer-a's "program stage running" record says
   ``ranks: 2`` and names the two worker containers' hosts, and each worker joined that stage's
   command group.

Reuses the image (``--image``, default ``localhost/nebula:dev``; built with ``podman-compose build``
only when missing or with ``--build``). ``--port-offset N`` moves every published port by N (through a
generated override file), so it can run beside another compose deployment of this repo;
``--image`` points every service at another tag the same way. Prints one JSON summary with the
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
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
FILES = ("docker-compose.yml", "docker-compose.ranks.yml")
DEFAULT_IMAGE = "localhost/nebula:dev"
RANKS = ("trainer-a-rank-0", "trainer-a-rank-1")
HEALTH_TIMEOUT_S = 300.0
JOIN_TIMEOUT_S = 180.0
# switch internal, trainer, auth, switch metrics (docker/smoke.py's --host-ports-*)
PORTS = {"a": (17400, 17500, 17600, 19100), "b": (27400, 27500, 27600, 29100)}


class SmokeFailure(Exception):
    pass


def check(condition: object, message: str) -> None:
    if not condition:
        raise SmokeFailure(message)


def log(message: str) -> None:
    print(f"smoke-ranks: {message}", file=sys.stderr, flush=True)


class Override(yaml.SafeDumper):
    """Dumps ``!override`` lists (podman-compose / compose v2 replace instead of appending)."""


class Replace(list):  # type: ignore[type-arg]
    pass


Override.add_representer(Replace, lambda dumper, data: dumper.represent_sequence("!override", data))


def override_file(directory: Path, image: str, offset: int, files: tuple[str, ...] = FILES) -> Path | None:
    """A further compose file with every service's image and published ports moved; None if not needed."""
    if image == DEFAULT_IMAGE and offset == 0:
        return None
    services: dict[str, dict[str, Any]] = {}
    for name in files:
        for service, body in yaml.safe_load((ROOT / name).read_text())["services"].items():
            entry = services.setdefault(service, {})
            if image != DEFAULT_IMAGE:
                entry["image"] = image
            if offset and body.get("ports"):
                moved = []
                for port in body["ports"]:
                    host, published, inner = str(port).rsplit(":", 2)
                    moved.append(f"{host}:{int(published) + offset}:{inner}")
                entry["ports"] = Replace(moved)
    path = directory / "compose.smoke-ranks.yml"
    path.write_text(yaml.dump({"services": services}, Dumper=Override, sort_keys=False))
    return path


class Compose:
    def __init__(self, project: str, extra: Path | None, files: tuple[str, ...] = FILES) -> None:
        tool = shlex.split(os.environ.get("COMPOSE", "podman-compose"))
        files = tuple(str(ROOT / f) for f in files) + ((str(extra),) if extra else ())
        self.project = project
        self.base = [*tool, "-p", project, *(arg for f in files for arg in ("-f", f))]

    def __call__(self, *args: str, timeout: float = 600.0) -> str:
        done = subprocess.run(
            [*self.base, *args], capture_output=True, text=True, timeout=timeout, check=False, cwd=ROOT
        )
        check(
            done.returncode == 0,
            f"`{shlex.join([*self.base, *args])}` exited {done.returncode}: {done.stderr[-800:]}",
        )
        return done.stdout

    def containers(self) -> dict[str, str]:
        """service -> container name, for this project's containers."""
        out = subprocess.run(
            ["podman", "ps", "-a", "--filter", f"label=io.podman.compose.project={self.project}",
             "--format", '{{.Names}} {{index .Labels "io.podman.compose.service"}}'],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip
        return {
            service: name for name, service in (line.split() for line in out.splitlines() if line.strip())
        }


def logs(container: str) -> str:
    done = subprocess.run(["podman", "logs", container], capture_output=True, text=True, timeout=60)
    return done.stdout + done.stderr


def healthy(container: str) -> bool:
    done = subprocess.run(["podman", "healthcheck", "run", container], capture_output=True, timeout=60)
    return done.returncode == 0


def wait(condition: Any, timeout: float, what: str) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise SmokeFailure(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(1.0)
    return time.monotonic() - started


def stage_records(trainer_log: str, job_id: str) -> list[dict[str, Any]]:
    """trainer-a's JSON "program stage running" records of ``job_id``."""
    found = []
    for line in trainer_log.splitlines():
        if line.startswith("{") and "program stage running" in line:
            record = json.loads(line)
            if record.get("message") == "program stage running" and record.get("job_id") == job_id:
                found.append(record)
    return found


def run(args: argparse.Namespace, compose: Compose, lap: Any) -> dict[str, Any]:
    compose("up", "-d", timeout=args.up_timeout)  # podman-compose starts the containers one by one
    lap("up -d")
    names = compose.containers()
    missing = [s for s in RANKS if s not in names]
    check(not missing, f"the worker containers {missing} were not created (services: {sorted(names)})")
    checked = [n for s, n in names.items() if s not in RANKS and s != "pki-init"]
    wait(lambda: all(healthy(n) for n in checked), HEALTH_TIMEOUT_S, "every service to be healthy")
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
    lap("both workers joined")

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cas = Path(tempfile.mkdtemp(prefix="smoke-ranks-ca-"))
    for cluster in "ab":
        env[f"NEBULA_ADMIN_PASSWORD_{cluster.upper()}"] = compose(
            "exec", "-T", f"auth-{cluster}", "cat", "/etc/nebula/admin/admin-password"
        ).strip()
        (cas / f"{cluster}-ca.crt").write_text(
            compose("exec", "-T", f"auth-{cluster}", "cat", "/etc/nebula/internal-tls/ca.crt")
        )
    ports = {c: ",".join(str(p + args.port_offset) for p in PORTS[c]) for c in "ab"}
    smoke = subprocess.run(
        [sys.executable, str(ROOT / "docker" / "smoke.py"), "--steps", str(args.steps),
         "--ca-a", str(cas / "a-ca.crt"), "--ca-b", str(cas / "b-ca.crt"),
         "--host-ports-a", ports["a"], "--host-ports-b", ports["b"]],
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
    return {
        "job_id": summary["job_id"],
        "succeeded": summary["succeeded"],
        "steps": summary["steps"],
        "losses": [round(x, 4) for x in summary["loss_per_step"]],
        "encoder_stage": {"ranks": record["ranks"], "rank_hosts": hosts},
        "workers": workers,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description="Cluster a's stage on two rank containers, for real.")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--project", default="nebula-ranks", help="compose project name")
    parser.add_argument("--image", default=DEFAULT_IMAGE)
    parser.add_argument("--build", action="store_true", help="build the image even if it exists")
    parser.add_argument("--port-offset", type=int, default=0, help="move every published port by this")
    parser.add_argument("--keep", action="store_true", help="leave the deployment up")
    parser.add_argument(
        "--up-timeout",
        type=float,
        default=1200.0,
        help="seconds for `up -d` (about 3 min on a quiet machine)",
    )
    args = parser.parse_args()
    started = phase = time.monotonic()
    timings: dict[str, float] = {}

    def lap(name: str) -> None:
        nonlocal phase
        timings[name] = round(time.monotonic() - phase, 1)
        log(f"{name}: {timings[name]} s (total {time.monotonic() - started:.0f} s)")
        phase = time.monotonic()

    with tempfile.TemporaryDirectory(prefix="smoke-ranks-") as tmp:
        compose = Compose(args.project, override_file(Path(tmp), args.image, args.port_offset))
        present = subprocess.run(["podman", "image", "exists", args.image], timeout=60).returncode == 0
        result: dict[str, Any] = {}
        status = 0
        try:
            if args.build or not present:
                compose("build", timeout=1800)
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
                subprocess.run([*compose.base, "down", "-v"], capture_output=True, timeout=600, cwd=ROOT)
                lap("down -v")
    result["timings_s"] = timings
    result["total_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(result, indent=2))
    return status


if __name__ == "__main__":
    sys.exit(main())
