"""`nebula local up | down | status`: two simulated clusters on this machine until interrupted.

``down`` and ``status`` also work on the run directory of a ``nebula cluster up`` (same lock file) and
name the command that holds it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from nebula_common.cli.console import new_console
from nebula_common.errors import NebulaError
from nebula_common.launcher import LocalDeployment
from nebula_common.launcher.local import CLUSTER_IDS, MAX_CLUSTERS
from nebula_common.launcher.organisation import ClusterDeployment
from nebula_common.launcher.process import ServiceStartError
from nebula_common.launcher.run_dir import running_deployment_pid
from nebula_common.launcher.supervisor import RestartPolicy
from nebula_common.sdk.deployment import ENDPOINTS, DeploymentTarget, write_endpoints_file

app = typer.Typer(help="Run simulated clusters locally.", no_args_is_help=True)
console = new_console()


def default_run_dir(kind: str) -> Path:
    return Path("runs") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


def _print_event(event: dict) -> None:
    name, what, detail = event["service"], event["event"], event["detail"]
    if what == "crash-loop":
        console.print(f"[bold red]{name} is crash-looping and was given up on[/]: {detail}")
    elif what == "died":
        console.print(f"[yellow]{name} died[/] ({detail})")
    elif what == "restarted":
        console.print(f"[green]{name} restarted[/] (restart {event['restarts']}, {detail})")
    else:
        console.print(f"[red]{name}: {what}[/] {detail}")


@app.command("up")
def up(
    run_dir: Path = typer.Option(
        None, help="Where PKI, data and logs go (default runs/local-<time>); an existing one is reused."
    ),
    bandwidth_mbit: float = typer.Option(60.0, min=0.001, help="Emulated WAN bandwidth per direction."),
    delay_ms: float = typer.Option(20.0, min=0.0, help="Emulated one-way WAN delay."),
    max_restarts: int = typer.Option(
        5, min=0, help="Give up on a service that dies more often than this within a minute."
    ),
    clusters: int = typer.Option(
        2,
        min=2,
        max=MAX_CLUSTERS,
        help="How many clusters (a, b, c, ...). Three or more: every switch links to every other one "
        "(chains of stages across them), through a WAN emulator in front of each accepting switch.",
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print the whole deployment description (deployment.json) once it is up."
    ),
    share: list[Path] = typer.Option(
        [],
        "--share",
        help="A folder the trainers read (read-only) besides their own, e.g. pre-trained weights a job names "
        "by absolute path; repeatable. A boxed trainer sees nothing else of this machine.",
    ),
) -> None:
    """Start clusters a and b (auth, codec, data, switch, trainer each) and the WAN emulator between them.

    With --clusters 3 (or more) also c, ...: each switch then has several peers, one link each.

    A service that dies is restarted on the same ports (capped exponential backoff); one that keeps
    dying is given up on and reported while the rest keep running. Ctrl-C stops everything.
    """
    run_dir = run_dir or default_run_dir("local")
    for folder in share:
        if not folder.is_dir():
            raise typer.BadParameter(f"{folder}: not a directory", param_hint="--share")
    deployment = LocalDeployment(
        run_dir=run_dir,
        bandwidth_mbit=bandwidth_mbit,
        delay_ms=delay_ms,
        clusters=tuple(CLUSTER_IDS[:clusters]),
        restart_policy=RestartPolicy(max_restarts=max_restarts),
        on_event=_print_event,
        shares=tuple(share),
    )
    reused = " (reusing its secrets, accounts and data)" if (run_dir / "pki").exists() else ""
    names = ", ".join(CLUSTER_IDS[:clusters])
    console.print(f"starting {clusters} clusters ({names}) in [bold]{run_dir}[/]{reused} ...")

    def announce() -> None:
        # The same deployment as an endpoints file: the one format every deployment kind offers.
        write_endpoints_file(DeploymentTarget.load(run_dir / "deployment.json"), run_dir / ENDPOINTS)
        description = deployment.describe()
        if as_json:
            console.print_json(json.dumps(description))
        else:
            for line in summary_lines(description):
                console.print(line, soft_wrap=True, highlight=False)
        console.print(
            f"[green]up[/]: PKI in {deployment.pki_dir}, logs in {deployment.log_dir}; "
            f"description in {run_dir / 'deployment.json'} (endpoints: {run_dir / ENDPOINTS}). "
            "Dead services are restarted. WAN faults: "
            f"`nebula wan cut|restore|reset --run-dir {run_dir}`. Ctrl-C (or `nebula local down "
            f"--run-dir {run_dir}`) stops everything. Internal ports are TLS: commands given bare "
            f"addresses verify them with NEBULA_CA_CERT={deployment.pki_dir}/<cluster>/ca.crt."
        )

    serve_until_stopped(deployment, run_dir, announce)


PORT_KEYS = {"switch": "internal_port", "wan": "wan_port"}


def summary_lines(description: dict[str, Any]) -> list[str]:
    """What a user needs from a fresh deployment, a line or two per cluster (``--json``: everything)."""
    lines = []
    for cluster, entry in description.get("clusters", {}).items():
        processes = entry.get("processes", {})
        ports: list[str] = []
        portless: list[str] = []
        isolation = edges = ""
        for name, process in processes.items():
            service = process.get("service", name.rsplit("-", 1)[0])
            port = process.get(PORT_KEYS.get(service, "grpc_port")) or process.get("grpc_port")
            state = "" if process.get("state") in (None, "running") else f" {process['state'].upper()}"
            if not port:  # the audit signer listens on Unix sockets only: named last
                portless.append(f"{service}{state}")
                continue
            ports.append(f"{service} :{port}{state}")
            if service == "switch" and process.get("wan_port"):
                ports[-1] += f" (WAN :{process['wan_port']})"
            isolation = process.get("stage_isolation") or isolation
            edges = process.get("stage_edges") or edges
        lines.append(f"cluster {cluster}: {'  '.join(ports + portless)}")
        if isolation:
            lines.append(f"  stages: {isolation}")
        if edges:
            lines.append(f"  stage edges: {edges}")
        if entry.get("admin_password_file"):
            lines.append(f"  admin password: {entry['admin_password_file']}")
    emulator = description.get("wan_emulator")
    if isinstance(emulator, dict) and "bandwidth_mbit" in emulator:
        lines.append(
            f"WAN emulator: {emulator['bandwidth_mbit']:g} Mbit/s and {emulator['delay_ms']:g} ms each way"
            + (f", {len(description['wan_emulators'])} links" if description.get("wan_emulators") else "")
        )
    return lines


def serve_until_stopped(
    deployment: LocalDeployment | ClusterDeployment, run_dir: Path, announce: Callable[[], None]
) -> None:
    """Start ``deployment`` and keep it up until SIGINT or SIGTERM (Ctrl-C, `nebula local down`); stop it.

    Used by `local up` and `cluster up`. Once the services are up, RUN_DIR/deployment.json is written
    and ``announce`` tells the user; the description is written again whenever the supervisor
    restarted a service (new pids, restart counts). A deployment that cannot start exits 1, saying why.
    """
    try:
        deployment.start()
    except (NebulaError, ServiceStartError) as exc:
        typer.echo(f"Error: {exc}", err=True)
        raise typer.Exit(1) from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        deployment.write_description(run_dir / "deployment.json")
        announce()
        supervisor = deployment.supervisor
        seen = supervisor.generation if supervisor is not None else 0
        while not stop.wait(0.5):
            if supervisor is not None and supervisor.generation != seen:
                seen = supervisor.generation
                deployment.write_description(run_dir / "deployment.json")  # new pids, restart counts
    finally:
        console.print("stopping ...")
        deployment.stop()


def deployment_command(run_dir: Path, pid: int) -> str | None:
    """The command holding RUN_DIR's lock as process ``pid`` ("nebula local up", "nebula cluster up").

    Read from deployment.json, which the holder writes once its services are up; None while it has not
    (or for a description left by an earlier deployment in the same directory: another pid).
    """
    try:
        description = json.loads((run_dir / "deployment.json").read_text(encoding="utf-8"))
        command = description["command"]
        if command["pid"] == pid and isinstance(command["name"], str):
            return command["name"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not written yet, or by an older Nebula
    return None


def _named(command: str | None) -> str:
    return f"`{command}`" if command else "the deployment"


@app.command("down")
def down(
    run_dir: Path = typer.Option(
        ..., help="Run directory of the running `nebula local up` or `nebula cluster up`."
    ),
    timeout: float = typer.Option(90.0, min=1.0, help="Seconds to wait for everything to stop."),
) -> None:
    """Stop the `nebula local up` or `cluster up` on RUN_DIR (as Ctrl-C would: every process, no restarts)."""
    pid = running_deployment_pid(run_dir)
    if pid is None:
        typer.echo(f"no deployment is running in {run_dir}")
        return
    command = _named(deployment_command(run_dir, pid))
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while running_deployment_pid(run_dir) is not None:
        if time.monotonic() > deadline:
            typer.echo(f"Error: {command} (pid {pid}) still running after {timeout:.0f}s", err=True)
            raise typer.Exit(1)
        time.sleep(0.2)
    typer.echo(f"stopped {command} in {run_dir} (pid {pid})")


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def deployment_status(run_dir: Path) -> dict:
    """Whether a `nebula local up` or `cluster up` holds RUN_DIR, and each service's pid, liveness, state
    and restarts."""
    pid = running_deployment_pid(run_dir)
    command = deployment_command(run_dir, pid) if pid is not None else None
    status: dict = {
        "run_dir": str(run_dir),
        "running": pid is not None,
        "pid": pid,
        "command": command,
        "services": {},
    }
    description_file = run_dir / "deployment.json"
    if pid is None or not description_file.exists():
        return status
    try:
        description = json.loads(description_file.read_text(encoding="utf-8"))
        status["clusters"] = sorted(description["clusters"])
        if description.get("service_isolation"):  # what keeps each service from the others' keys
            status["service_isolation"] = description["service_isolation"]
        for cluster, entry in sorted(description["clusters"].items()):
            for name, info in sorted(entry["processes"].items()):
                status["services"][name] = {
                    "cluster": cluster,
                    "pid": info.get("pid"),
                    "alive": _alive(info.get("pid")),
                    "state": info.get("state"),
                    "restarts": info.get("restarts", 0),
                    "ports": {k: v for k, v in info.items() if k.endswith("_port")},
                }
                for key in ("stage_isolation", "stage_edges"):  # how the trainer confines its stages and
                    if key in info:  # carries their edges: never silent
                        status["services"][name][key] = info[key]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        status["error"] = f"{description_file}: unreadable deployment description ({exc})"
    return status


@app.command("status")
def status(
    run_dir: Path = typer.Option(..., help="Run directory of a `nebula local up` or `nebula cluster up`."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of text."),
) -> None:
    """Is a `nebula local up` or `cluster up` running on RUN_DIR, and how is each service?

    Exit 0 if up, 3 if not.
    """
    if not run_dir.is_dir():
        typer.echo(f"Error: {run_dir} is not a directory", err=True)
        raise typer.Exit(2)
    result = deployment_status(run_dir)
    if as_json:
        typer.echo(json.dumps(result, indent=2, sort_keys=True))
    elif not result["running"]:
        typer.echo(f"no deployment is running in {run_dir}")
    else:
        typer.echo(f"deployment in {run_dir} is up ({_named(result['command'])}, pid {result['pid']})")
        for name, service in result["services"].items():
            alive = "alive" if service["alive"] else "NOT ALIVE"
            ports = ", ".join(f"{k} {v}" for k, v in sorted(service["ports"].items()))
            typer.echo(
                f"  {name:14} pid {service['pid']} {alive}, {service['state']}, "
                f"{service['restarts']} restarts; {ports}"
            )
            if service.get("stage_isolation"):
                typer.echo(f"  {'':14} stages: {service['stage_isolation']}")
            if service.get("stage_edges"):
                typer.echo(f"  {'':14} stage edges: {service['stage_edges']}")
        if result.get("clusters"):
            typer.echo(f"  clusters: {', '.join(result['clusters'])}")
        if result.get("service_isolation"):
            typer.echo(f"  services: {result['service_isolation']}")
        if "error" in result:
            typer.echo(result["error"], err=True)
    if not result["running"]:
        raise typer.Exit(3)
