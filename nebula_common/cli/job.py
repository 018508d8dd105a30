"""`nebula job`: submit a user job (YAML spec + stage modules) to a running deployment, follow it.

Credentials, our choice: by default the command creates a fresh account in
each cluster through that cluster's own admin (the admin password file that
`nebula local up` lists in deployment.json), exactly as an operator onboarding a
researcher would; with ``--credentials FILE`` (YAML ``{<cluster>: {username,
password}}``) it logs in with existing accounts instead. Either way each
cluster's stage is assigned with that cluster's own token.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from nebula_common.errors import NebulaError
from nebula_common.jobspec import SpecError, load_spec
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.auth_client import AuthClient
from nebula_common.sdk.client import ClusterEndpoints, ClusterSession, common_checkpoint_step, submit_job
from nebula_common.sdk.codec_advice import LinkProfile
from nebula_common.sdk.jobs import ProgramJob
from nebula_common.sdk.summary import JobSummary, summarize

app = typer.Typer(help="Submit and follow split training jobs.", no_args_is_help=True)
console = Console()
LOOPBACK = "127.0.0.1"


class DeploymentFileError(NebulaError):
    pass


def endpoints_from_description(description: dict[str, Any]) -> dict[str, tuple[ClusterEndpoints, Path]]:
    """Cluster id -> (endpoints, admin password file) from a `nebula local up` deployment.json."""
    result = {}
    try:
        for cluster, entry in description["clusters"].items():
            processes = entry["processes"]
            metrics = {
                name: f"http://{LOOPBACK}:{info['metrics_port']}/metrics"
                for name, info in processes.items()
                if (info.get("metrics_port") or -1) > 0
            }
            endpoints = ClusterEndpoints(
                cluster_id=cluster,
                auth=f"{LOOPBACK}:{processes[f'auth-{cluster}']['grpc_port']}",
                trainer=f"{LOOPBACK}:{processes[f'trainer-{cluster}']['grpc_port']}",
                switch=f"{LOOPBACK}:{processes[f'switch-{cluster}']['internal_port']}",
                metrics=metrics,
                codec=f"{LOOPBACK}:{processes[f'codec-{cluster}']['grpc_port']}",
            )
            result[cluster] = (endpoints, Path(entry["admin_password_file"]))
    except (KeyError, TypeError, AttributeError) as exc:
        raise DeploymentFileError(f"deployment description is missing {exc}") from exc
    return result


def link_from_description(description: dict[str, Any]) -> LinkProfile | None:
    """The emulated WAN's shape from a deployment.json (what `codec: auto` is advised for)."""
    emulator = description.get("wan_emulator")
    if not isinstance(emulator, dict) or "bandwidth_mbit" not in emulator:
        return None
    return LinkProfile(
        bandwidth_mbit=float(emulator["bandwidth_mbit"]), rtt_ms=2 * float(emulator["delay_ms"])
    )


def onboard(endpoints: ClusterEndpoints, admin_password: str, username: str) -> ClusterSession:
    """Create an account through the cluster's own admin and log it in."""
    password = secrets.token_urlsafe(18)
    with AuthClient(endpoints.auth) as auth:
        admin = auth.login("admin", admin_password)
        auth.create_account(admin.token, username, password, role="user")
    return ClusterSession.login(endpoints, username, password)


def sessions_for(
    deployment_file: Path, credentials: Path | None, clusters: set[str]
) -> dict[str, ClusterSession]:
    try:
        description = json.loads(deployment_file.read_text())
    except (OSError, ValueError) as exc:
        raise DeploymentFileError(f"cannot read deployment description {deployment_file}: {exc}") from exc
    known = endpoints_from_description(description)
    unknown = sorted(clusters - set(known))
    if unknown:
        raise DeploymentFileError(f"the job names cluster(s) {', '.join(unknown)} not in {deployment_file}")
    creds: dict[str, Any] = {}
    if credentials is not None:
        creds = yaml.safe_load(credentials.read_text()) or {}
        if not isinstance(creds, dict):
            raise DeploymentFileError(f"{credentials}: expected a mapping cluster -> {{username, password}}")
    sessions = {}
    for cluster in sorted(clusters):
        endpoints, admin_file = known[cluster]
        if cluster in creds:
            entry = creds[cluster]
            if not isinstance(entry, dict) or not {"username", "password"} <= set(entry):
                raise DeploymentFileError(f"{credentials}: {cluster}: needs username and password")
            sessions[cluster] = ClusterSession.login(
                endpoints, str(entry["username"]), str(entry["password"])
            )
        else:
            name = f"job-{secrets.token_hex(3)}"
            sessions[cluster] = onboard(endpoints, admin_file.read_text().strip(), name)
    return sessions


def follow(
    job: ProgramJob,
    sessions: dict[str, ClusterSession],
    quiet: bool = False,
    link: LinkProfile | None = None,
) -> JobSummary:
    """Submit the job and follow it with a progress bar; returns the summary (WAN numbers filled).

    ``link`` describes the WAN for `codec: auto` (resolved once by the source cluster's codec service).
    """
    handle = submit_job(job, sessions, link=link)
    if job.codec_choice and json.loads(job.codec_choice).get("source") != "configured" and not quiet:
        console.print(f"codec advice: forward={job.codec_forward} backward={job.codec_backward}")
    columns = (
        TextColumn(f"[bold]{job.spec.name}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("step {task.fields[step_ms]} ms"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, disable=quiet) as progress:
        task = progress.add_task("train", total=job.steps, completed=job.start_step, loss="-", step_ms="-")
        on_step: Callable[[trainer_pb2.StageStatus], None] = lambda status: progress.update(  # noqa: E731
            task,
            completed=status.steps_done,
            loss=f"{status.loss:.4f}" if status.HasField("loss") else "-",
            step_ms=f"{status.step_seconds * 1000:.0f}",
        )
        shown: set[tuple[str, int]] = set()

        def on_status(status: trainer_pb2.StageStatus) -> None:
            """A stage that lost its attempt says so once per epoch, with why (its trainer restarted...)."""
            if status.state != trainer_pb2.STAGE_STATE_RECOVERING or (status.stage, status.epoch) in shown:
                return
            shown.add((status.stage, status.epoch))
            progress.console.print(
                f"[yellow]{status.stage}: RECOVERING (epoch {status.epoch}): {status.message}[/]"
            )

        summary = summarize(job, handle, on_step=on_step, on_status=on_status)
    ordered = [sessions[c] for c in job.clusters().values()]
    summary.fill_wan(ordered[0], ordered[1])
    summary.settings = {
        "spec": str(job.loaded.spec_path) if job.loaded.spec_path else None,
        "schedule": job.spec.pipeline.schedule,
        "mode": job.spec.pipeline.mode,
        "replicas": {stage.name: stage.replicas for stage in job.spec.stages},
        "micro_batches": job.spec.data.micro_batches,
        "batch_size": job.spec.data.batch_size,
        "codec_forward": job.codec_forward,
        "codec_backward": job.codec_backward,
        "codec_choice": json.loads(job.codec_choice),
        "resumed_from": f"{job.resume_job_id}@{job.resume_step}" if job.resume_job_id else None,
        "hot_start_steps": job.initial_step if job.initial_states else None,
    }
    return summary


def print_summary(summary: JobSummary) -> None:
    table = Table(title=f"job {summary.job_id}", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for stage, state in summary.stage_states.items():
        table.add_row(f"{stage} stage", state)
    table.add_row("steps", str(summary.steps_done))
    if summary.losses:
        table.add_row("loss first -> last", f"{summary.losses[0]:.4f} -> {summary.losses[-1]:.4f}")
    for stage, own in summary.local_losses.items():
        table.add_row(f"{stage} own loss first -> last", f"{own[0]:.4f} -> {own[-1]:.4f}")
    table.add_row("training wall time", f"{summary.train_seconds:.1f} s")
    table.add_row("mean step time", f"{summary.mean_step_seconds * 1000:.1f} ms")
    for stage, fraction in summary.to_json()["wait_fraction"].items():
        table.add_row(f"{stage} waiting for the peer", f"{fraction:.1%}")
    for stage, step in summary.checkpoint_steps.items():
        if step:
            table.add_row(f"{stage} last checkpoint", f"step {step}")
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


def parse_overrides(items: list[str]) -> dict[str, Any]:
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"--set {item!r}: expected KEY=VALUE, e.g. data.micro_batches=4")
        overrides[key] = yaml.safe_load(value)
    return overrides


@app.command("submit")
def submit(
    spec: Path = typer.Argument(..., help="The job spec (YAML)."),
    deployment: Path = typer.Option(
        ..., help="deployment.json written by `nebula local up` (ports, admin password files)."
    ),
    credentials: Path = typer.Option(
        None, help="YAML {cluster: {username, password}}; default: new accounts via each cluster's admin."
    ),
    overrides: list[str] = typer.Option([], "--set", help="Override a spec field, e.g. --set steps=10."),
    resume: str = typer.Option(
        None, help="Resume this earlier job (same accounts) from its latest checkpoint held by every cluster."
    ),
    json_path: Path = typer.Option(None, "--json", help="Write the JSON summary here."),
    link_mbit: float = typer.Option(
        None, min=0.001, help="WAN bandwidth for `codec: auto` advice (default: the deployment's emulator)."
    ),
    link_rtt_ms: float = typer.Option(None, min=0.0, help="WAN round-trip time for `codec: auto` advice."),
    hot_start_steps: int = typer.Option(
        None,
        min=1,
        help="Hot start (paper Fig. 8): train the first N steps unsplit here, then continue split; each "
        "cluster gets only its stage's model/optimizer/scheduler state.",
    ),
) -> None:
    """Validate the spec and its modules, then run each stage in its cluster and follow the job."""
    if resume and hot_start_steps:
        raise typer.BadParameter("--resume and --hot-start-steps are exclusive: a job starts from one state")
    if resume and credentials is None:
        raise typer.BadParameter(
            "--resume needs --credentials: checkpoints belong to the accounts that made them"
        )
    try:
        loaded = load_spec(spec, parse_overrides(overrides))
    except SpecError as exc:  # plain text on stderr: the message quotes the user's input (no markup)
        typer.echo(f"invalid job spec\n{exc}", err=True)
        raise typer.Exit(2) from None
    try:
        if hot_start_steps:
            console.print(f"hot start: training steps 0..{hot_start_steps - 1} unsplit in this process")
            job, local = ProgramJob.hot_started(loaded, hot_start_steps)
            console.print(
                f"hot start: loss {local.losses[0]:.4f} -> {local.losses[-1]:.4f}; continuing split"
            )
        else:
            job = ProgramJob(loaded)
        sessions = sessions_for(deployment, credentials, set(job.clusters().values()))
        if resume:
            stages = {stage: sessions[cluster] for stage, cluster in job.clusters().items()}
            step = common_checkpoint_step(resume, stages)
            if step is None:
                raise NebulaError(f"no checkpoint of job {resume!r} held by every cluster for these accounts")
            job = ProgramJob(loaded, resume_job_id=resume, resume_step=step)
        console.print(f"job [bold]{job.job_id}[/]: stages {job.clusters()}")
        link = link_from_description(json.loads(deployment.read_text()))
        if link_mbit is not None or link_rtt_ms is not None:
            link = LinkProfile(
                bandwidth_mbit=link_mbit
                if link_mbit is not None
                else (link.bandwidth_mbit if link else 60.0),
                rtt_ms=link_rtt_ms if link_rtt_ms is not None else (link.rtt_ms if link else 40.0),
            )
        summary = follow(job, sessions, link=link)
    except (NebulaError, ValueError) as exc:
        console.print(f"[red]job failed:[/] {exc}")
        raise typer.Exit(1) from exc
    print_summary(summary)
    if json_path is not None:
        json_path.write_text(json.dumps(summary.to_json(), indent=2))
        console.print(f"summary written to {json_path}")
    if not summary.succeeded:
        raise typer.Exit(1)
