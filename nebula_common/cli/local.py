"""`nebula local up`: two simulated clusters on this machine until interrupted."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import typer
from rich.console import Console

from nebula_common.launcher import LocalDeployment

app = typer.Typer(help="Run simulated clusters locally.", no_args_is_help=True)
console = Console()


def default_run_dir(kind: str) -> Path:
    return Path("runs") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


@app.command("up")
def up(
    run_dir: Path = typer.Option(None, help="Where PKI, data and logs go (default runs/local-<time>)."),
    bandwidth_mbit: float = typer.Option(60.0, min=0.001, help="Emulated WAN bandwidth per direction."),
    delay_ms: float = typer.Option(20.0, min=0.0, help="Emulated one-way WAN delay."),
) -> None:
    """Start clusters a and b (auth, codec, switch, trainer each) with the WAN emulator between switches."""
    run_dir = run_dir or default_run_dir("local")
    deployment = LocalDeployment(run_dir=run_dir, bandwidth_mbit=bandwidth_mbit, delay_ms=delay_ms)
    console.print(f"starting two clusters in [bold]{run_dir}[/] ...")
    deployment.start()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        description = deployment.describe()
        deployment.write_description(run_dir / "deployment.json")
        console.print_json(json.dumps(description))
        console.print(
            f"[green]up[/]: PKI in {deployment.pki_dir}, logs in {deployment.log_dir}; "
            f"description in {run_dir / 'deployment.json'}. Ctrl-C stops everything."
        )
        while not stop.wait(1.0):
            dead = [
                p.name
                for s in deployment.cluster_state.values()
                for p in s.processes()
                if p.popen.poll() is not None
            ]
            if dead:
                console.print(f"[red]process(es) exited: {', '.join(dead)}; see {deployment.log_dir}[/]")
                raise typer.Exit(1)
    finally:
        console.print("stopping ...")
        deployment.stop()
