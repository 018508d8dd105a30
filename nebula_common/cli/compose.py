"""`nebula compose endpoints`: one endpoints file for a running compose deployment (docker-compose.yml).

The compose deployment publishes each cluster's auth, trainer, switch, switch metrics and data ports on
127.0.0.1 (see docker-compose.yml); every one of them is internal TLS, verified against the
cluster's own CA, which only the containers hold. This command reads where each port is published from
the compose file (literal ``HOST:PORT:CONTAINER`` mappings; any other is asked of the engine,
``<compose> port``), copies each cluster's CA certificate and, unless
``--no-admin``, its bootstrap admin password (mode 0600) out of the auth containers
(``<compose> exec -T``), and the scraper identity through ``pki-init``, and writes them with
``endpoints.json`` into one host directory. From
then on every CLI command and the SDK target the deployment with ``--deployment DIR`` (or
``Deployment.open(DIR)``), as they target a local run directory: ``nebula job list|status|watch|
cancel|report|logs``, ``nebula job submit`` and ``nebula account``. ``nebula job logs`` reads the
containers' logs through the same engine (``<compose> logs --no-color SERVICE``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import typer
import yaml

from nebula_common.durable import atomic_write
from nebula_common.sdk.deployment import ENDPOINTS, ENDPOINTS_FORMAT

app = typer.Typer(help="Target a compose deployment from this host.", no_args_is_help=True)

# Container ports (docker-compose.yml: "Fixed container ports").
AUTH, TRAINER, SWITCH, METRICS, DATA = 7600, 7500, 7400, 9100, 7800
CA_IN_CONTAINER = "/etc/nebula/internal-tls/ca.crt"
ADMIN_IN_CONTAINER = "/etc/nebula/admin/admin-password"
LOGGED = ("trainer", "switch")  # the services whose log records name jobs (`nebula job logs`)
TIMEOUT_S = 60.0
PEM_BLOCK = re.compile(r"-----BEGIN ([A-Z ]+)-----.*?-----END \1-----", re.S)


class ComposeError(Exception):
    """A compose command failed (the message names it and its error)."""


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ComposeError(f"`{shlex.join(argv)}`: {exc}") from None
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise ComposeError(f"`{shlex.join(argv)}` exited {done.returncode}: {last[0]}")
    return done.stdout


def fetch_monitoring_identity(compose: list[str], cluster: str, target: Path) -> Path:
    """Copy ``cluster``'s scraper identity (role ``monitoring``) out of the PKI volume into ``target``.

    Every ``/metrics`` answers only that identity (or an operator's). No service container holds it,
    so it is read through the one-shot ``pki-init`` (which mounts the PKI volume, and nothing else
    runs): ``<compose> run --rm --no-deps -T pki-init cat ...``. The key is written 0600.
    """
    source = f"/pki/{cluster}/services/monitoring"
    names = ("ca.crt", "service.crt", "service.key")
    text = _run(
        [*compose, "run", "--rm", "--no-deps", "-T", "pki-init", "cat", *(f"{source}/{n}" for n in names)]
    )
    blocks = [m.group(0) for m in PEM_BLOCK.finditer(text)]
    if len(blocks) != 3 or "PRIVATE KEY" not in blocks[2]:
        raise ComposeError(f"pki-init: {source} does not hold a monitoring identity (re-run pki-init)")
    target.mkdir(parents=True, exist_ok=True)
    for name, block in zip(names, blocks, strict=True):
        atomic_write(
            target / name, (block.strip() + "\n").encode(), mode=0o600 if name.endswith(".key") else 0o644
        )
    return target


def published(compose: list[str], service: str, port: int, host: str) -> str:
    """HOST:PORT where ``service``'s container ``port`` is published (docker prints IP:PORT, podman PORT)."""
    out = _run([*compose, "port", service, str(port)]).strip().splitlines()
    value = out[-1].strip() if out else ""
    published_port = value.rpartition(":")[2]
    if not published_port.isdigit():
        raise ComposeError(f"{service} publishes no port for {port} (got {value!r}): is the deployment up?")
    return f"{host}:{published_port}"


def declared_ports(file: Path) -> dict[tuple[str, int], str]:
    """(service, container port) -> HOST:PORT for every literal ``"HOST:PORT:CONTAINER"`` mapping.

    Reading them from the file costs nothing; a compose engine's ``port`` costs a process start
    each (seconds on a busy machine). A mapping with a variable or without a host address is left
    to the engine.
    """
    try:
        body = yaml.safe_load(file.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    found: dict[tuple[str, int], str] = {}
    services = body.get("services") if isinstance(body, dict) else None
    for name, service in (services or {}).items():
        for mapping in (service or {}).get("ports") or [] if isinstance(service, dict) else []:
            parts = str(mapping).split(":")
            if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit() and "$" not in parts[0]:
                found[(str(name), int(parts[2]))] = f"{parts[0]}:{parts[1]}"
    return found


@app.command("endpoints")
def endpoints(
    out: Path = typer.Option(
        Path("runs/compose"), help="Directory for endpoints.json, the CA certificates and admin passwords."
    ),
    compose_command: str = typer.Option(
        "podman-compose", "--compose", envvar="COMPOSE", help="The compose engine (e.g. 'docker compose')."
    ),
    file: Path = typer.Option(Path("docker-compose.yml"), "--file", "-f", help="The compose file."),
    clusters: str = typer.Option("a,b", help="Cluster ids, comma-separated (services <name>-<cluster>)."),
    host: str = typer.Option("127.0.0.1", help="The address the ports are published on."),
    bandwidth_mbit: float = typer.Option(
        float(os.environ.get("WAN_MBIT", "60")), min=0.001, help="The WAN emulator's bandwidth ($WAN_MBIT)."
    ),
    delay_ms: float = typer.Option(
        float(os.environ.get("WAN_DELAY_MS", "20")), min=0.0, help="Its one-way delay ($WAN_DELAY_MS)."
    ),
    admin: bool = typer.Option(True, "--admin/--no-admin", help="Copy each cluster's admin password (0600)."),
) -> None:
    """Write DIR/endpoints.json for the running compose deployment: `--deployment DIR` targets it."""
    if not file.is_file():
        typer.echo(f"Error: no compose file {file}", err=True)
        raise typer.Exit(2)
    compose = [*shlex.split(compose_command), "-f", str(file.resolve())]
    declared = declared_ports(file)

    def address(service: str, port: int) -> str:
        return declared.get((service, port)) or published(compose, service, port, host)

    names = [c.strip() for c in clusters.split(",") if c.strip()]
    body: dict = {"nebula_endpoints": ENDPOINTS_FORMAT, "clusters": {}}
    try:
        out.mkdir(parents=True, exist_ok=True)
        for cluster in names:
            ca = out / f"{cluster}-ca.crt"
            pem = _run([*compose, "exec", "-T", f"auth-{cluster}", "cat", CA_IN_CONTAINER])
            if "BEGIN CERTIFICATE" not in pem:
                raise ComposeError(f"auth-{cluster}: {CA_IN_CONTAINER} is not a PEM certificate")
            atomic_write(ca, pem.encode(), mode=0o644)
            metrics = address(f"switch-{cluster}", METRICS)
            scraper = fetch_monitoring_identity(compose, cluster, out / f"{cluster}-monitoring")
            entry = {
                "auth": address(f"auth-{cluster}", AUTH),
                "trainer": address(f"trainer-{cluster}", TRAINER),
                "switch": address(f"switch-{cluster}", SWITCH),
                "ca_cert": ca.name,
                "metrics": {f"switch-{cluster}": f"https://{metrics}/metrics"},
                "monitoring_tls": scraper.name,
            }
            if admin:
                secret = _run([*compose, "exec", "-T", f"auth-{cluster}", "cat", ADMIN_IN_CONTAINER]).strip()
                if not secret:
                    raise ComposeError(f"auth-{cluster}: {ADMIN_IN_CONTAINER} is empty")
                atomic_write(out / f"{cluster}-admin-password", (secret + "\n").encode(), mode=0o600)
                entry["admin_password_file"] = f"{cluster}-admin-password"
            try:  # optional: only `nebula account grants` needs it; a compose file may not publish it
                entry["data"] = address(f"data-{cluster}", DATA)
            except ComposeError as exc:
                typer.echo(f"note: no data service address for cluster {cluster} ({exc})", err=True)
            body["clusters"][cluster] = entry
    except (ComposeError, OSError) as exc:
        typer.echo(f"Error: {exc}", err=True)
        raise typer.Exit(1) from None
    body["link"] = {"bandwidth_mbit": bandwidth_mbit, "rtt_ms": 2 * delay_ms}
    body["logs"] = {
        "command": [*compose, "logs", "--no-color"],
        "services": [f"{service}-{cluster}" for cluster in names for service in LOGGED],
    }
    path = out / ENDPOINTS
    atomic_write(path, (json.dumps(body, indent=2) + "\n").encode(), mode=0o644)
    typer.echo(f"wrote {path}; target the deployment with --deployment {out}")


__all__ = ["app", "declared_ports", "published"]
