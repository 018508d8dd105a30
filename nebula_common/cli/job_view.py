"""`nebula job list | status | watch | logs | cancel`: find a job again, follow it, stop it.

A job's record lives in the trainers (``Trainer/ListStages``, on disk, through restarts); these
commands ask every cluster of the deployment with that cluster's own account and merge the
stages into one job (``nebula_common.sdk.job_records``). Whose jobs: ``--credentials FILE``
(YAML ``{cluster: {username, password}}``) shows only that account's jobs, as each trainer
answers only a stage's owner; without it the commands act as each cluster's admin (the admin
password files a ``nebula local up`` deployment lists), who sees every job. Another account's
job is "not found", never "forbidden": its existence is not the caller's to learn.

Every command takes ``--json`` (one JSON document; ``watch`` one JSON object per line), so
scripts never parse tables.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from nebula_common.cli.job import app, console
from nebula_common.errors import NebulaError
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.api import Deployment
from nebula_common.sdk.client import ClusterSession, JobHandle
from nebula_common.sdk.deployment import DeploymentTarget, read_credentials
from nebula_common.sdk.job_records import (
    CANCEL_WAIT_S,
    JobNotFoundError,
    JobRecord,
    cancel_job,
    get_job,
    list_jobs,
)
from nebula_common.sdk.progress import ProgressBar, Throughput
from nebula_common.sdk.report import write_report

DEPLOYMENT_HELP = "deployment.json written by `nebula local up` (ports, admin password files)."
CREDENTIALS_HELP = (
    "YAML {cluster: {username, password}}: act as that account (default: each cluster's admin)."
)


def view_sessions(deployment: Path, credentials: Path | None) -> list[ClusterSession]:
    """One logged-in session per cluster: the ``credentials`` account's (where it has one), or the admin's."""
    target = DeploymentTarget.load(deployment)
    creds = read_credentials(credentials)
    if creds is None:
        return list(target.admin_sessions().values())
    return list(target.login(creds).values())


def _emit_json(body: object) -> None:
    typer.echo(json.dumps(body, indent=2, default=str))


def _when(unix: float | None) -> str:
    if not unix:
        return "-"
    return datetime.datetime.fromtimestamp(unix, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _fail(exc: Exception) -> typer.Exit:
    console.print(f"[red]error:[/] {exc}")
    return typer.Exit(1)


def _close(sessions: list[ClusterSession]) -> None:
    for session in sessions:
        session.close()


@app.command("list")
def list_command(
    deployment: Path = typer.Option(..., help=DEPLOYMENT_HELP),
    credentials: Path = typer.Option(None, help=CREDENTIALS_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """The jobs you may see (yours; an admin's: every job), oldest first, running and ended."""
    sessions: list[ClusterSession] = []
    try:
        sessions = view_sessions(deployment, credentials)
        jobs = list_jobs(sessions)
    except NebulaError as exc:
        raise _fail(exc) from None
    finally:
        _close(sessions)
    if as_json:
        _emit_json([job.to_json() for job in jobs])
        return
    table = Table(title=f"{len(jobs)} job(s)")
    for column in ("job", "state", "owners", "steps", "loss", "started (UTC)", "ended (UTC)"):
        table.add_column(column)
    for job in jobs:
        owners = ", ".join(f"{c}:{o}" for c, o in job.owners.items())
        steps = f"{job.steps_done}/{job.steps}"
        table.add_row(
            job.job_id,
            job.state,
            owners,
            steps,
            _loss(job.loss),
            _when(job.started_unix),
            _when(job.ended_unix),
        )
    console.print(table)


def print_status(job: JobRecord) -> None:
    """A job's record as a table: the whole, then how each stage is doing or how it ended and why."""
    table = Table(title=f"job {job.job_id}: {job.state}", show_header=False)
    table.add_column("field")
    table.add_column("value")
    table.add_row("spec digest", job.spec_digest or "-")
    table.add_row("steps", f"{job.steps_done}/{job.steps}")
    table.add_row("loss", _loss(job.loss))
    table.add_row("started / ended (UTC)", f"{_when(job.started_unix)} / {_when(job.ended_unix)}")
    for direction, traffic in job.traffic().items():
        table.add_row(
            f"{direction} ({traffic['codec']})",
            f"{traffic['bytes']:,} B, x{traffic['compression_ratio']:.2f} vs none",
        )
    for stage in job.stages:
        how = stage.state + (f": {stage.message}" if stage.message else "")
        table.add_row(f"{stage.stage} @ {stage.cluster} ({stage.owner})", how)
    console.print(table)


@app.command("status")
def status_command(
    job_id: str = typer.Argument(..., metavar="JOB", help="The job id (from `nebula job list`)."),
    deployment: Path = typer.Option(..., help=DEPLOYMENT_HELP),
    credentials: Path = typer.Option(None, help=CREDENTIALS_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """One job's record: owners, clusters, codecs, state, step, loss, bytes, and how each stage ended."""
    sessions: list[ClusterSession] = []
    try:
        sessions = view_sessions(deployment, credentials)
        job = get_job(sessions, job_id)
    except NebulaError as exc:
        raise _fail(exc) from None
    finally:
        _close(sessions)
    if as_json:
        _emit_json(job.to_json())
    else:
        print_status(job)


@dataclass(frozen=True)
class _Watched:
    """What ``JobHandle`` needs of a job it did not submit: its id and length."""

    job_id: str
    steps: int


def follow_job(
    sessions: list[ClusterSession], job: JobRecord
) -> Iterator[tuple[trainer_pb2.StageStatus, float]]:
    """Every status of the job's stages until all have ended, with the WAN throughput at that moment."""
    by_cluster = {s.endpoints.cluster_id: s for s in sessions}
    stages = {stage.stage: by_cluster[stage.cluster] for stage in job.stages}
    handle = JobHandle(_Watched(job.job_id, job.steps), stages)
    rate = Throughput()
    for update in handle.updates():
        yield update.status, rate.add(update.status)


@app.command("watch")
def watch_command(
    job_id: str = typer.Argument(..., metavar="JOB", help="The job id (from `nebula job list`)."),
    deployment: Path = typer.Option(..., help=DEPLOYMENT_HELP),
    credentials: Path = typer.Option(None, help=CREDENTIALS_HELP),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per status update."),
) -> None:
    """Follow a job to its end: step, loss, step time and WAN throughput, then how it ended."""
    sessions: list[ClusterSession] = []
    try:
        sessions = view_sessions(deployment, credentials)
        job = get_job(sessions, job_id)
        if as_json:
            for status, mbit in follow_job(sessions, job):
                typer.echo(json.dumps(_status_json(status, mbit)))
        else:
            _watch_progress(sessions, job)
        job = get_job(sessions, job_id)
    except NebulaError as exc:
        raise _fail(exc) from None
    finally:
        _close(sessions)
    if as_json:
        typer.echo(json.dumps({"final": job.to_json()}))
    else:
        print_status(job)


def _status_json(status: trainer_pb2.StageStatus, mbit: float) -> dict[str, Any]:
    return {
        "stage": status.stage,
        "state": trainer_pb2.StageState.Name(status.state).removeprefix("STAGE_STATE_"),
        "steps_done": status.steps_done,
        "loss": status.loss if status.HasField("loss") else None,
        "step_seconds": status.step_seconds,
        "bytes_sent": status.bytes_sent,
        "wan_mbit_s": round(mbit, 3),
        "message": status.message,
    }


def _watch_progress(sessions: list[ClusterSession], job: JobRecord) -> None:
    with ProgressBar(job.job_id, job.steps, job.steps_done, console=console) as bar:
        for status, _ in follow_job(sessions, job):
            bar.update(status)


@app.command("cancel")
def cancel_command(
    job_id: str = typer.Argument(..., metavar="JOB", help="The job id (from `nebula job list`)."),
    deployment: Path = typer.Option(..., help=DEPLOYMENT_HELP),
    credentials: Path = typer.Option(None, help=CREDENTIALS_HELP),
    wait_s: float = typer.Option(
        CANCEL_WAIT_S, "--wait", min=0.0, help="Seconds to wait for both stages to stop."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the job's record after the cancel as JSON."),
) -> None:
    """Stop every stage of a job, in every cluster, and say how each one ended."""
    sessions: list[ClusterSession] = []
    try:
        sessions = view_sessions(deployment, credentials)
        job = cancel_job(sessions, job_id, wait_s)
    except NebulaError as exc:
        raise _fail(exc) from None
    finally:
        _close(sessions)
    if as_json:
        _emit_json(job.to_json())
        return
    print_status(job)
    if not job.ended:
        console.print(
            f"[yellow]not every stage had stopped after {wait_s:g} s; `nebula job status {job_id}`[/]"
        )
        raise typer.Exit(1)
    console.print(f"job {job_id} stopped: " + ", ".join(f"{s.stage} {s.state}" for s in job.stages))


@app.command("report")
def report_command(
    job_id: str = typer.Argument(..., metavar="JOB", help="The job id (from `nebula job list`)."),
    deployment: Path = typer.Option(..., help=DEPLOYMENT_HELP),
    credentials: Path = typer.Option(None, help=CREDENTIALS_HELP),
    out: Path = typer.Option(None, help="The HTML page to write (default: <JOB>-report.html here)."),
    as_json: bool = typer.Option(False, "--json", help="Print the written paths as JSON."),
) -> None:
    """Write one HTML page about a job (and PNGs where matplotlib is installed): loss per step, step
    time, WAN throughput against the link, codec ratio, the codec advice, how each stage ended.

    A running job is followed to its end first.
    """
    out = out or Path(f"{job_id}-report.html")
    target: Deployment | None = None
    try:
        target = Deployment.open(deployment, credentials)
        job = target.job(job_id)
        summary = job.wait()
        page, pngs = write_report(summary, job.status(), target.link, out)
    except (NebulaError, ValueError) as exc:
        raise _fail(exc) from None
    finally:
        if target is not None:
            target.close()
    if as_json:
        _emit_json({"job_id": job_id, "html": str(page), "png": [str(p) for p in pngs]})
        return
    console.print(f"report written to {page}" + (f" (and {len(pngs)} PNG charts)" if pngs else ""))


@app.command("logs")
def logs_command(
    job_id: str = typer.Argument(..., metavar="JOB", help="The job id (from `nebula job list`)."),
    deployment: Path = typer.Option(..., help=DEPLOYMENT_HELP),
    credentials: Path = typer.Option(None, help=CREDENTIALS_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the log records as a JSON list."),
) -> None:
    """The services' log records about a job (a `nebula local up` deployment's log files), in time order.

    Shown only to who may see the job (its owner or an admin, asked of the trainers first).
    """
    sessions: list[ClusterSession] = []
    try:
        sessions = view_sessions(deployment, credentials)
        get_job(sessions, job_id)
        records = job_log_records(json.loads(deployment.read_text()), job_id)
    except (NebulaError, ValueError) as exc:
        raise _fail(exc) from None
    finally:
        _close(sessions)
    if as_json:
        _emit_json(records)
        return
    for record in records:
        typer.echo(
            f"{record.get('ts', '-')} {record.get('service', '-'):<8} {record.get('severity', '-'):<7} "
            f"{record.get('message', '')}"
        )


def job_log_records(description: dict[str, Any], job_id: str) -> list[dict[str, Any]]:
    """Every JSON log record naming ``job_id`` in the deployment's log directory, oldest first."""
    log_dir = description.get("log_dir")
    if not isinstance(log_dir, str) or not Path(log_dir).is_dir():
        raise JobNotFoundError(
            "this deployment description names no log directory (only `nebula local up` writes one); "
            "read the services' logs where they run (e.g. `docker compose logs trainer-a`)"
        )
    records = []
    for path in sorted(Path(log_dir).glob("*.log")):
        with path.open(errors="replace") as lines:
            for line in lines:
                if job_id not in line:
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and record.get("job_id") == job_id:
                    records.append(record)
    return sorted(records, key=lambda r: str(r.get("ts", "")))


__all__ = ["follow_job", "job_log_records", "view_sessions"]
