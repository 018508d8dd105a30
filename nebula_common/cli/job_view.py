"""`nebula job list | status | watch | logs | cancel | report`: find a job again, follow it, stop it.

A job's record lives in the trainers (``Trainer/ListStages``, on disk, through restarts); these
commands are thin shells over the SDK's ``Deployment`` and ``Job`` (``nebula_common.sdk.api``),
which ask every cluster with that cluster's own account and merge the stages into one job. Whose
jobs: ``--credentials FILE`` (YAML ``{cluster: {username, password}}``) shows only that account's
jobs, as each trainer answers only a stage's owner; without it the commands act as each cluster's
admin (the admin password files a ``nebula local up`` deployment lists), who sees every job.
Another account's job is "not found", never "forbidden": its existence is not the caller's to learn.

Every command takes ``--json`` (one JSON document; ``watch`` one JSON object per line), so
scripts never parse tables.
"""

from __future__ import annotations

import contextlib
import datetime
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from nebula_common.cli.console import new_console
from nebula_common.cli.job import app, console, reattach_hint
from nebula_common.errors import NebulaError
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.api import Deployment, Job
from nebula_common.sdk.contexts import resolve as resolve_identity
from nebula_common.sdk.job_records import CANCEL_WAIT_S, JobRecord
from nebula_common.sdk.progress import ProgressBar, Throughput
from nebula_common.sdk.report import write_report

DEPLOYMENT_HELP = (
    "A run directory, its deployment.json or an endpoints file (default: the current context's, "
    "`nebula login`)."
)
CREDENTIALS_HELP = (
    "YAML {cluster: {username, password}}: act as that account (default: the account `nebula login` "
    "keeps for this deployment, else each cluster's admin)."
)
JOB_HELP = "The job id (from `nebula job list`)."


@contextlib.contextmanager
def opened(deployment: Path | None, credentials: Path | None) -> Iterator[Deployment]:
    """The deployment as the given account (or the login's, or the admins); any Nebula error exits 1
    with its message."""
    target: Deployment | None = None
    try:
        where, identity, _ = resolve_identity(deployment, credentials)
        target = Deployment.open(where, identity)
        if target.records_note:  # on stderr: --json output stays one document
            typer.echo(target.records_note, err=True)
        yield target
    except (NebulaError, ValueError) as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from None
    finally:
        if target is not None:
            target.close()


def _emit_json(body: object) -> None:
    typer.echo(json.dumps(body, indent=2, default=str))


def _when(unix: float | None) -> str:
    if not unix:
        return "-"
    return datetime.datetime.fromtimestamp(unix, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


LIST_COLUMNS = ("job", "state", "steps", "loss", "owners", "started (UTC)", "ended (UTC)")
LIST_DROP_ORDER = ("started (UTC)", "ended (UTC)", "owners", "loss", "steps")
"""Columns ``job list`` leaves out, in this order, when the terminal is too narrow: never the id."""


def _list_rows(jobs: list[JobRecord]) -> list[dict[str, str]]:
    return [
        {
            "job": job.job_id,
            "state": job.state,
            "steps": f"{job.steps_done}/{job.steps}",
            "loss": _loss(job.loss),
            "owners": ", ".join(f"{c}:{o}" for c, o in job.owners.items()),
            "started (UTC)": _when(job.started_unix),
            "ended (UTC)": _when(job.ended_unix),
        }
        for job in jobs
    ]


def jobs_table(jobs: list[JobRecord], width: int | None) -> Table:
    """The job list as a table that fits ``width`` (None: every column) without cutting an id.

    The id and the state never wrap; when the table cannot fit, the least useful columns are left out
    (``LIST_DROP_ORDER``) before anything of the id would be.
    """
    from rich.measure import Measurement

    rows = _list_rows(jobs)
    columns = list(LIST_COLUMNS)

    def build() -> Table:
        table = Table(title=f"{len(jobs)} job(s)")
        for column in columns:
            whole = column in ("job", "state")
            table.add_column(
                column,
                no_wrap=whole,
                min_width=max((len(r[column]) for r in rows), default=0) if whole else None,
            )
        for row in rows:
            table.add_row(*(row[c] for c in columns))
        return table

    table = build()
    if width is None:
        return table
    measuring = new_console(width=10_000)
    for column in LIST_DROP_ORDER:
        if Measurement.get(measuring, measuring.options, table).minimum <= width:
            break
        columns.remove(column)
        table = build()
    return table


@app.command("list")
def list_command(
    deployment: Path = typer.Option(None, help=DEPLOYMENT_HELP),
    credentials: Path = typer.Option(None, help=CREDENTIALS_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    output: str = typer.Option(
        "table",
        "--output",
        "-o",
        help="table: fit the terminal, leaving columns out before an id is cut; wide: every column, "
        "whatever the width; name: one job id per line (for scripts and shells).",
    ),
) -> None:
    """The jobs you may see (yours; an admin's: every job), oldest first, running and ended."""
    if output not in ("table", "wide", "name"):
        raise typer.BadParameter(f"{output!r}: choose table, wide or name", param_hint="'--output'")
    with opened(deployment, credentials) as target:
        jobs = target.jobs()
    if as_json:
        _emit_json([job.to_json() for job in jobs])
        return
    if output == "name":
        for job in jobs:
            typer.echo(job.job_id)
        return
    if output == "wide":
        from rich.measure import Measurement

        table = jobs_table(jobs, None)
        wide = new_console(width=10_000)
        needed = Measurement.get(wide, wide.options, table).maximum
        new_console(width=max(needed, console.width)).print(table)
        return
    console.print(jobs_table(jobs, console.width))


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
    job_id: str = typer.Argument(..., metavar="JOB", help=JOB_HELP),
    deployment: Path = typer.Option(None, help=DEPLOYMENT_HELP),
    credentials: Path = typer.Option(None, help=CREDENTIALS_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """One job's record: owners, clusters, codecs, state, step, loss, bytes, and how each stage ended."""
    with opened(deployment, credentials) as target:
        job = target.job(job_id).status()
    if as_json:
        _emit_json(job.to_json())
    else:
        print_status(job)


@app.command("watch")
def watch_command(
    job_id: str = typer.Argument(..., metavar="JOB", help=JOB_HELP),
    deployment: Path = typer.Option(None, help=DEPLOYMENT_HELP),
    credentials: Path = typer.Option(None, help=CREDENTIALS_HELP),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per status update."),
) -> None:
    """Follow a job to its end (an ended one: replay it): step, loss, step time, WAN throughput.

    Ctrl-C stops watching, never the job.
    """
    with opened(deployment, credentials) as target:
        job = target.job(job_id)
        try:
            if as_json:
                rate = Throughput()
                for status in job.metrics():
                    typer.echo(json.dumps(_status_json(status, rate.add(status))))
            else:
                _watch_progress(job)
        except KeyboardInterrupt:
            console.print(f"stopped watching; the job runs on. {reattach_hint(job_id, deployment)}")
            raise typer.Exit(130) from None
        final = job.status()
    if as_json:
        typer.echo(json.dumps({"final": final.to_json()}))
    else:
        print_status(final)


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


def _watch_progress(job: Job) -> None:
    record = job.status()
    with ProgressBar(job.id, record.steps, record.steps_done, console=console) as bar:
        for status in job.metrics():
            bar.update(status)


@app.command("cancel")
def cancel_command(
    job_id: str = typer.Argument(..., metavar="JOB", help=JOB_HELP),
    deployment: Path = typer.Option(None, help=DEPLOYMENT_HELP),
    credentials: Path = typer.Option(None, help=CREDENTIALS_HELP),
    wait_s: float = typer.Option(
        CANCEL_WAIT_S, "--wait", min=0.0, help="Seconds to wait for both stages to stop."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the job's record after the cancel as JSON."),
) -> None:
    """Stop every stage of a job, in every cluster, and say how each one ended."""
    with opened(deployment, credentials) as target:
        job = target.job(job_id).cancel(wait_s)
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
    job_id: str = typer.Argument(..., metavar="JOB", help=JOB_HELP),
    deployment: Path = typer.Option(None, help=DEPLOYMENT_HELP),
    credentials: Path = typer.Option(None, help=CREDENTIALS_HELP),
    out: Path = typer.Option(None, help="The HTML page to write (default: <JOB>-report.html here)."),
    as_json: bool = typer.Option(False, "--json", help="Print the written paths as JSON."),
) -> None:
    """Write one HTML page about a job (and PNGs where matplotlib is installed): loss per step, step
    time, WAN throughput against the link, codec ratio, the codec advice, how each stage ended.

    A running job is followed to its end first.
    """
    out = out or Path(f"{job_id}-report.html")
    with opened(deployment, credentials) as target:
        job = target.job(job_id)
        page, pngs = write_report(job.wait(), job.status(), target.link, out)
    if as_json:
        _emit_json({"job_id": job_id, "html": str(page), "png": [str(p) for p in pngs]})
        return
    console.print(f"report written to {page}" + (f" (and {len(pngs)} PNG charts)" if pngs else ""))


@app.command("logs")
def logs_command(
    job_id: str = typer.Argument(..., metavar="JOB", help=JOB_HELP),
    deployment: Path = typer.Option(None, help=DEPLOYMENT_HELP),
    credentials: Path = typer.Option(None, help=CREDENTIALS_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the log records as a JSON list."),
) -> None:
    """The services' log records about a job (a `nebula local up` deployment's log files), in time order.

    Shown only to who may see the job (its owner or an admin, asked of the trainers first).
    """
    with opened(deployment, credentials) as target:
        records = target.job(job_id).logs()  # not found for whoever may not see the job
    if as_json:
        _emit_json(records)
        return
    for record in records:
        typer.echo(
            f"{record.get('ts', '-')} {_source(record):<10} {record.get('severity', '-'):<7} "
            f"{record.get('message', '')}"
        )


def _source(record: dict[str, Any]) -> str:
    """Which process said it, service and cluster (``trainer-a``), however the record was read."""
    source = record.get("source")
    if isinstance(source, str) and source:
        return source
    service, cluster = record.get("service", "-"), record.get("cluster_id")
    return f"{service}-{cluster}" if cluster else str(service)


__all__ = ["opened", "print_status"]
