"""`nebula demo`: PKI, two clusters, one account each, the ABNet job over the emulated WAN, a summary."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from nebula_common.errors import NebulaError
from nebula_common.launcher import LocalDeployment
from nebula_common.sdk.auth_client import AuthClient
from nebula_common.sdk.client import ClusterSession, submit_abnet
from nebula_common.sdk.jobs import AbnetJob
from nebula_common.sdk.summary import JobSummary, summarize

console = Console()


def _create_account(deployment: LocalDeployment, cluster: str, username: str) -> ClusterSession:
    """Each organisation creates its own account with its own admin; tokens never cross clusters."""
    endpoints = deployment.endpoints(cluster)
    password = secrets.token_urlsafe(18)
    with AuthClient(endpoints.auth) as auth:
        admin = auth.login("admin", deployment.cluster_state[cluster].admin_password)
        auth.create_account(admin.token, username, password, role="user")
    return ClusterSession.login(endpoints, username, password)


def demo(
    steps: int = typer.Option(60, min=1, help="Optimizer steps."),
    bandwidth_mbit: float = typer.Option(
        60.0, min=0.001, help="Emulated WAN bandwidth per direction (Mbit/s)."
    ),
    delay_ms: float = typer.Option(20.0, min=0.0, help="Emulated one-way WAN delay (ms)."),
    codec_forward: str = typer.Option("none", help="Codec for activations (a->b), e.g. fp16, int8."),
    codec_backward: str = typer.Option("none", help="Codec for activation gradients (b->a)."),
    micro_batches: int = typer.Option(2, min=1, help="Micro-batches per step (pipelined across the WAN)."),
    batch_size: int = typer.Option(128, min=1, help="Examples per step."),
    json_path: Path = typer.Option(None, "--json", help="Write the JSON summary here."),
    run_dir: Path = typer.Option(None, help="Where PKI, data and logs go (default runs/demo-<time>)."),
) -> None:
    """Run the ABNet job across two simulated clusters and print what crossed the WAN."""
    try:
        job = AbnetJob(
            steps=steps,
            codec_forward=codec_forward,
            codec_backward=codec_backward,
            micro_batches=micro_batches,
            batch_size=batch_size,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    run_dir = run_dir or Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    console.print(
        f"[bold]Nebula demo[/]: clusters a and b, WAN {bandwidth_mbit:g} Mbit/s, {delay_ms:g} ms one-way; "
        f"codecs forward={job.codec_forward} backward={job.codec_backward}; run dir {run_dir}"
    )
    started = time.perf_counter()
    deployment = LocalDeployment(run_dir=run_dir, bandwidth_mbit=bandwidth_mbit, delay_ms=delay_ms)
    try:
        with console.status("starting PKI, auth, codec, switches, WAN emulator and trainers ..."):
            deployment.start()  # stops whatever it started if any process fails to come up
        console.print(f"clusters up in {time.perf_counter() - started:.1f}s (logs: {deployment.log_dir})")
        source = _create_account(deployment, "a", "researcher-a")
        target = _create_account(deployment, "b", "researcher-b")
        summary = _train(job, source, target)
        summary.fill_wan(source, target)
    except NebulaError as exc:
        console.print(f"[red]demo failed:[/] {exc}")
        raise typer.Exit(1) from exc
    finally:
        with console.status("stopping every process ..."):
            deployment.stop()
    summary.total_seconds = time.perf_counter() - started
    summary.settings = {
        "bandwidth_mbit": bandwidth_mbit,
        "delay_ms": delay_ms,
        "codec_forward": job.codec_forward,
        "codec_backward": job.codec_backward,
        "micro_batches": micro_batches,
        "batch_size": batch_size,
        "run_dir": str(run_dir),
    }
    _print_summary(summary)
    if json_path is not None:
        json_path.write_text(json.dumps(summary.to_json(), indent=2))
        console.print(f"summary written to {json_path}")
    if not summary.succeeded:
        raise typer.Exit(1)


def _train(job: AbnetJob, source: ClusterSession, target: ClusterSession) -> JobSummary:
    handle = submit_abnet(job, source, target)
    columns = (
        TextColumn("[bold]training"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("step {task.fields[step_ms]} ms"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("train", total=job.steps, loss="-", step_ms="-")
        return summarize(
            job,
            handle,
            on_step=lambda status: progress.update(
                task,
                completed=status.steps_done,
                loss=f"{status.loss:.4f}" if status.HasField("loss") else "-",
                step_ms=f"{status.step_seconds * 1000:.0f}",
            ),
        )


def _print_summary(summary: JobSummary) -> None:
    table = Table(title=f"job {summary.job_id}", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for stage, state in summary.stage_states.items():
        table.add_row(f"{stage} stage", state)
    table.add_row("steps", str(summary.steps_done))
    if summary.losses:
        table.add_row("loss first -> last", f"{summary.losses[0]:.4f} -> {summary.losses[-1]:.4f}")
    table.add_row("training wall time", f"{summary.train_seconds:.1f} s")
    table.add_row("mean step time", f"{summary.mean_step_seconds * 1000:.1f} ms")
    for direction, wan in summary.wan.items():
        table.add_row(
            f"WAN {direction} ({wan['from']}->{wan['to']})",
            f"{wan['bytes']:,} B  (x{wan['compression_ratio']:.2f} vs none)",
        )
    for cluster, identity in summary.peer_identities.items():
        table.add_row(f"switch {cluster} verified peer", identity)
    console.print(table)
    for stage, message in summary.stage_messages.items():
        if message:
            console.print(f"[yellow]{stage}: {message}[/]")
