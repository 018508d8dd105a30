"""What every host-side compose smoke needs, written once: the compose command, the image, health, a
cluster's admin secrets, logs on failure, and ``down -v`` always.

Used by docker/smoke_ranks.py, docker/smoke_three_clusters.py and docker/smoke_ops.py (all run from the
repo root with ``PYTHONPATH=$PWD``; this directory is on ``sys.path`` because the scripts live in it).
A smoke written on it is a function ``body(compose, timings) -> dict`` handed to :func:`run_smoke`,
which builds the image if needed (a cached build: nothing new when the image is fresh), brings nothing
up itself, and on any failure prints each container's last log lines, then ``down -v`` (unless
``--keep``) and one JSON summary with the phase timings.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_IMAGE = "localhost/nebula:dev"
# The one compose file with the image's `build:` (the others reuse its image, pull_policy: never).
BUILD_FILE = "docker-compose.yml"
ADMIN_PASSWORD = "/etc/nebula/admin/admin-password"
INTERNAL_CA = "/etc/nebula/internal-tls/ca.crt"
SWITCH_AUDIT_LOG = "/var/lib/nebula/switch/audit.log"


class SmokeFailure(Exception):
    """The first thing that was not as expected (the message says what)."""


def check(condition: object, message: str) -> None:
    if not condition:
        raise SmokeFailure(message)


def logger(name: str) -> Callable[[str], None]:
    def log(message: str) -> None:
        print(f"{name}: {message}", file=sys.stderr, flush=True)

    return log


class Compose:
    """``<engine> [-p PROJECT] -f FILE...`` from the repo root; COMPOSE names the engine (podman-compose).

    ``project`` None keeps the project name the file (or COMPOSE) gives.
    """

    def __init__(self, project: str | None, files: Iterable[str], extra: Path | None = None) -> None:
        tool = shlex.split(os.environ.get("COMPOSE", "podman-compose"))
        paths = [str(ROOT / f) for f in files] + ([str(extra)] if extra else [])
        self.project = project
        self.base = [*tool, *(["-p", project] if project else []), *(a for f in paths for a in ("-f", f))]

    def __call__(self, *args: str, timeout: float = 600.0) -> str:
        """Runs one compose command; its stdout, or SmokeFailure naming the command and its stderr."""
        done = subprocess.run(
            [*self.base, *args], capture_output=True, text=True, timeout=timeout, check=False, cwd=ROOT
        )
        check(
            done.returncode == 0,
            f"`{shlex.join([*self.base, *args])}` exited {done.returncode}: {done.stderr[-800:]}",
        )
        return done.stdout

    def exec_in(self, service: str, *command: str) -> str:
        """``exec -T SERVICE COMMAND...``: its stdout."""
        return self("exec", "-T", service, *command)

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

    def wait_healthy(self, skip: Iterable[str] = (), timeout: float = 300.0) -> dict[str, str]:
        """Waits until every container but the one-shots (pki-init, signer-init-*) and ``skip`` is healthy.

        podman 4.3 runs healthchecks only when asked (no systemd timers), so this asks, once a second.
        Returns service -> container name for all of the project's containers.
        """
        names = self.containers()
        one_shot = ("pki-init", "signer-init-")
        checked = [n for s, n in names.items() if not s.startswith(one_shot) and s not in set(skip)]
        check(checked, f"project {self.project} has no containers to check")
        wait(
            lambda: all(healthy(n) for n in checked), timeout, f"every service to be healthy ({len(checked)})"
        )
        return names

    def admin_secrets(self, clusters: Iterable[str], directory: Path) -> dict[str, tuple[str, Path]]:
        """cluster -> (bootstrap admin password, its internal CA certificate copied to ``directory``)."""
        found = {}
        for cluster in clusters:
            password = self("exec", "-T", f"auth-{cluster}", "cat", ADMIN_PASSWORD).strip()
            check(password, f"auth-{cluster}: {ADMIN_PASSWORD} is empty")
            ca = directory / f"{cluster}-ca.crt"
            ca.write_text(self("exec", "-T", f"auth-{cluster}", "cat", INTERNAL_CA))
            found[cluster] = (password, ca)
        return found

    def log_tails(self, log: Callable[[str], None], lines: int = 4) -> None:
        """Each container's state and last log lines (what a failure report needs)."""
        for service, name in sorted(self.containers().items()):
            tail = logs(name).strip().splitlines()[-lines:]
            log(f"--- {service} ({name})\n" + "\n".join(tail))

    def down(self, timeout: float = 900.0) -> None:
        """``down -v``: containers, networks and volumes; never raises (it runs after failures)."""
        try:
            subprocess.run([*self.base, "down", "-v"], capture_output=True, timeout=timeout, cwd=ROOT)
        except (OSError, subprocess.TimeoutExpired) as exc:
            print(f"`{shlex.join([*self.base, 'down', '-v'])}` failed: {exc}", file=sys.stderr)


def exec_prefix(prefix: str) -> Callable[..., str]:
    """Runs ``PREFIX CONTAINER COMMAND...`` (``podman-compose -p P exec -T`` and a service, or
    ``podman exec`` and a container) from the repo root: its stdout, or SmokeFailure naming it."""

    def run(container: str, *command: str) -> str:
        argv = [*shlex.split(prefix), container, *command]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False, cwd=ROOT)
        check(done.returncode == 0, f"`{shlex.join(argv)}` exited {done.returncode}: {done.stderr[-800:]}")
        return done.stdout

    return run


def edge_transports(exec_in: Callable[..., str], switch: str, job_id: str) -> list[str]:
    """The carrier of each edge of ``job_id`` that ``switch`` opened: its audit log's ``edge.open``
    records (``transport`` is absent for gRPC, ``records`` on the edge socket). ``exec_in(switch,
    *command)`` runs a command in the switch's container (``Compose.exec_in``, ``exec_prefix``)."""
    opened = []
    for line in exec_in(switch, "cat", SWITCH_AUDIT_LOG).splitlines():
        record = json.loads(line) if line.strip() else {}
        if (record.get("event"), record.get("job_id"), record.get("outcome")) == ("edge.open", job_id, "ok"):
            opened.append(str((record.get("details") or {}).get("transport", "grpc")))
    return opened


def check_edge_transports(
    exec_in: Callable[..., str], expected: dict[str, str], job_id: str
) -> dict[str, list[str]]:
    """Each switch of ``expected`` opened edges of ``job_id``, every one on the carrier named there:
    ``records`` (on its edge socket: what compose gives the stages a trainer runs itself) or ``grpc``
    (through the trainer's stage proxy: stages on cluster ranks). switch -> the transports seen, or
    SmokeFailure."""
    seen = {switch: edge_transports(exec_in, switch, job_id) for switch in expected}
    for switch, transports in seen.items():
        check(transports, f"{switch} opened no edge of job {job_id} (its audit log has no edge.open)")
        check(
            set(transports) == {expected[switch]},
            f"{switch} opened edges of job {job_id} as {transports}, not all {expected[switch]}",
        )
    return seen


def logs(container: str) -> str:
    done = subprocess.run(["podman", "logs", container], capture_output=True, text=True, timeout=60)
    return done.stdout + done.stderr


def healthy(container: str) -> bool:
    done = subprocess.run(["podman", "healthcheck", "run", container], capture_output=True, timeout=60)
    return done.returncode == 0


def wait(condition: Callable[[], object], timeout: float, what: str) -> float:
    """Polls ``condition`` once a second; its wait in seconds, or SmokeFailure naming ``what``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise SmokeFailure(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(1.0)
    return time.monotonic() - started


class _Override(yaml.SafeDumper):
    """Dumps ``!override`` lists (podman-compose / compose v2 replace instead of appending)."""


class _Replace(list):  # type: ignore[type-arg]
    pass


_Override.add_representer(_Replace, lambda dumper, data: dumper.represent_sequence("!override", data))


def override_file(directory: Path, image: str, offset: int, files: Iterable[str]) -> Path | None:
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
                entry["ports"] = _Replace(moved)
    path = directory / "compose.smoke-override.yml"
    path.write_text(yaml.dump({"services": services}, Dumper=_Override, sort_keys=False))
    return path


class Timings:
    """Phase timings: ``lap(name)`` records the time since the last lap and logs it."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.log = log
        self.started = self.phase = time.monotonic()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.laps[name] = round(now - self.phase, 1)
        self.log(f"{name}: {self.laps[name]} s (total {now - self.started:.0f} s)")
        self.phase = now

    def restart(self) -> None:
        self.phase = time.monotonic()


def ensure_image(image: str, build: bool, timings: Timings) -> None:
    """The image the smoke runs, fresh: ``podman-compose build`` of docker-compose.yml, as
    ``make smoke-containers`` builds it (layer cache: nothing new when the sources did not change).

    ``build`` False only checks that the image exists (``--no-build``: a CI step right after another
    smoke's build).
    """
    present = subprocess.run(["podman", "image", "exists", image], timeout=60).returncode == 0
    if not build:
        check(present, f"image {image} does not exist (drop --no-build to build it)")
        return
    Compose(None, (BUILD_FILE,))("build", timeout=1800)
    if image != DEFAULT_IMAGE:
        subprocess.run(["podman", "tag", DEFAULT_IMAGE, image], check=True, timeout=60)
    timings.lap("build (layer cache)" if present else "build (no image yet)")


def add_arguments(parser: argparse.ArgumentParser, project: str, up_timeout: float) -> None:
    """The options every compose smoke takes."""
    parser.add_argument("--project", default=project, help="compose project name")
    parser.add_argument("--image", default=DEFAULT_IMAGE)
    parser.add_argument(
        "--no-build",
        dest="build",
        action="store_false",
        help="use the image as it is (by default a cached build keeps it fresh)",
    )
    parser.add_argument("--port-offset", type=int, default=0, help="move every published port by this")
    parser.add_argument("--keep", action="store_true", help="leave the deployment up")
    parser.add_argument("--up-timeout", type=float, default=up_timeout, help="seconds for `up -d`")


def run_smoke(
    name: str,
    args: argparse.Namespace,
    files: tuple[str, ...],
    body: Callable[[Compose, Timings], dict[str, Any]],
) -> int:
    """Runs ``body`` on the project ``args.project`` of ``files``: the image first, then ``down -v``
    always (also on failure, Ctrl-C or SIGTERM) unless ``--keep``. Prints one JSON summary; 0 on
    success."""
    log = logger(name)
    timings = Timings(log)
    # A CI timeout's SIGTERM unwinds like Ctrl-C, so the `finally` below still takes the deployment down.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    result: dict[str, Any] = {}
    status = 1
    with tempfile.TemporaryDirectory(prefix=f"{name}-") as tmp:
        compose = Compose(args.project, files, override_file(Path(tmp), args.image, args.port_offset, files))
        try:
            ensure_image(args.image, args.build, timings)
            result = body(compose, timings)
            status = 0
        except (SmokeFailure, subprocess.TimeoutExpired, subprocess.CalledProcessError) as exc:
            log(f"FAILED: {exc}")
            compose.log_tails(log)
            result["failed"] = str(exc)[-2000:]  # again at the end: CI keeps only the tail of a long log
        finally:
            if not args.keep:
                timings.restart()
                compose.down()
                timings.lap("down -v")
    result["timings_s"] = timings.laps
    result["total_s"] = round(time.monotonic() - timings.started, 1)
    print(json.dumps(result, indent=2))
    return status
