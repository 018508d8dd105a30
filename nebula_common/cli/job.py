"""`nebula job`: submit a user job (YAML spec + stage modules) to a running deployment, follow it.

Credentials, our choice: by default the command creates a fresh account in
each cluster through that cluster's own admin (the admin password file that
`nebula local up` lists in deployment.json), exactly as an operator onboarding a
researcher would; with ``--credentials FILE`` (YAML ``{<cluster>: {username,
password}}``) it logs in with existing accounts instead. Either way each
cluster's stage is assigned with that cluster's own token. The passwords of accounts it creates are
stored once in ``<run dir>/credentials/<name>.yaml`` (0600) and that path is printed.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from nebula_common.cli.console import new_console
from nebula_common.credentials import CredentialsError, store_new
from nebula_common.errors import NebulaError
from nebula_common.safe_yaml import YamlInputError, load_yaml_text
from nebula_common.sdk.client import (
    ClusterEndpoints,
    ClusterSession,
    JobHandle,
    common_checkpoint_step,
    submit_job,
)
from nebula_common.sdk.contexts import resolve as resolve_identity
from nebula_common.sdk.deployment import (
    Credentials,
    DeploymentFileError,
    DeploymentTarget,
    read_credentials,
)
from nebula_common.sdk.deployment import onboard as onboard_account
from nebula_common.sdk.jobs import ProgramJob
from nebula_common.sdk.links import LinkProfile
from nebula_common.sdk.progress import ProgressBar
from nebula_common.sdk.summary import JobSummary, chain_edges, summarize

app = typer.Typer(help="Submit and follow split training jobs.", no_args_is_help=True)
console = new_console()


def onboard(endpoints: ClusterEndpoints, admin_password: str, username: str) -> ClusterSession:
    """Create an account through the cluster's own admin and log it in."""
    return onboard_account(endpoints, admin_password, username)[0]


def stopped_message(target: DeploymentTarget) -> str:
    return (
        f"the deployment in {target.run_dir} is stopped: start it again first "
        f"(`nebula local up --run-dir {target.run_dir}`); its running jobs resume by themselves"
    )


def sessions_for(
    deployment_file: Path, credentials: Path | Credentials | None, clusters: set[str]
) -> dict[str, ClusterSession]:
    """A session per cluster of the job: the ``credentials`` accounts, else fresh ones via the admins."""
    target = DeploymentTarget.load(deployment_file)
    if target.stopped_records() is not None:
        raise NebulaError(stopped_message(target))
    target.check_clusters(clusters)
    given = {c: entry for c, entry in (read_credentials(credentials) or {}).items() if c in clusters}
    sessions = target.login(given)
    if clusters - set(given):
        created_sessions, created = target.new_accounts(clusters - set(given))
        sessions.update(created_sessions)
        keep_created(target.run_dir, created)
    return sessions


def keep_created(run_dir: Path, created: Credentials) -> Path | None:
    """Store the passwords of accounts this command created (0600, never over an existing file).

    Without this they would exist nowhere but in the clusters: nobody could resume, list or cancel
    the job as its owner later. The path is printed once; if the file cannot be written the
    passwords themselves are shown once instead (the accounts exist already, so they must not be lost).
    """
    username = next(iter(created.values()))["username"]
    passwords = {cluster: entry["password"] for cluster, entry in created.items()}
    where = ", ".join(sorted(passwords))
    try:
        path = store_new(run_dir, username, passwords)
    except (CredentialsError, OSError) as exc:
        typer.echo(f"could not store the new account's credentials: {exc}", err=True)
        for cluster, password in sorted(passwords.items()):
            typer.echo(
                f"account {username!r} in cluster {cluster}; password (shown once): {password}", err=True
            )
        return None
    console.print(
        f"new account {username!r} in cluster(s) {where}; credentials stored in {path} (mode 0600); "
        f"reuse them with --credentials {path}",
        markup=False,
        highlight=False,
        soft_wrap=True,  # one line, so the path can be copied whole
    )
    return path


def print_placements(job: ProgramJob, handle: JobHandle) -> None:
    """Where each cluster runs its stage and how it is confined, as its trainer answered the submit."""
    for stage, placement in handle.placements.items():
        if placement:  # an older trainer says nothing
            console.print(f"[dim]stage {stage} on {job.clusters()[stage]}: {placement}[/]")


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
    if not quiet:
        print_placements(job, handle)
    choice = json.loads(job.codec_choice) if job.codec_choice else {}
    if choice.get("source") == "per-edge" and not quiet:  # a chain: one choice per edge
        for record in choice["edges"]:
            console.print(
                f"codec {record['source']} on {record['edge']}: "
                f"forward={record['forward']} backward={record['backward']}"
            )
    elif choice and choice.get("source") != "configured" and not quiet:
        console.print(f"codec advice: forward={job.codec_forward} backward={job.codec_backward}")
    with ProgressBar(job.spec.name, job.steps, job.start_step, console=console, disable=quiet) as bar:
        summary = summarize(job, handle, on_status=bar.update)
    ordered_ids = list(job.clusters().values())
    ordered = [sessions[c] for c in ordered_ids]
    if len(ordered) == 2:  # a chain's switches count each job's bytes over all their peers together
        summary.fill_wan(ordered[0], ordered[1])
    else:  # so a chain's numbers come per edge: its switches' per-peer series (or its stages' counters)
        summary.fill_chain_wan(chain_edges(job), {cluster: sessions[cluster] for cluster in ordered_ids})
    summary.settings = job.settings()
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
            f"{wan.get('bytes', wan['payload_bytes']):,} B  (x{wan['compression_ratio']:.2f} vs none)",
        )
    for name, directions in summary.wan_edges.items():
        for direction, wan in directions.items():
            table.add_row(
                f"WAN {name} {direction} ({wan['from']}->{wan['to']})",
                f"{wan.get('bytes', wan['payload_bytes']):,} B in {wan['frames']:,} frames  "
                f"(x{wan['compression_ratio']:.2f} vs none)",
            )
    for cluster, identity in summary.peer_identities.items():
        links = summary.links.get(cluster, {})
        if len(links) <= 1:
            carrier = next(iter(links.values()), {}).get("link_carrier", "")
            table.add_row(
                f"switch {cluster} verified peer", f"{identity} ({carrier})" if carrier else identity
            )
            continue
        for peer, link in links.items():  # a switch with several peers: each link, named
            state = "up" if link["connected"] else "down"
            table.add_row(
                f"switch {cluster} link to {peer}",
                f"{state} {link['verified_peer_identity']} {link.get('link_carrier', '')}".strip(),
            )
    console.print(table)
    for stage, message in summary.stage_messages.items():
        if message:
            console.print(f"[yellow]{stage}: {message}[/]")


def reattach_hint(job_id: str, deployment: Path) -> str:
    return (
        f"Follow it: nebula job watch {job_id} --deployment {deployment}; "
        f"stop it: nebula job cancel {job_id} --deployment {deployment}"
    )


def interrupted(job_id: str, sessions: dict[str, ClusterSession], deployment: Path) -> None:
    """Ctrl-C while following a job: ask whether to cancel it; without a terminal, leave it running.

    The job runs in the clusters, not in this process: leaving is harmless, and cancelling on an
    unattended Ctrl-C (a CI timeout, a closed ssh session) would throw its work away unasked.
    """
    console.print(f"\n[yellow]interrupted: job {job_id} is still running in every cluster[/]")
    if sys.stdin.isatty() and typer.confirm(f"Cancel job {job_id} in every cluster?", default=False):
        for session in sessions.values():
            session.cancel(job_id)
        console.print(f"job {job_id}: cancel sent to every cluster ({', '.join(sorted(sessions))})")
        return
    console.print(f"left running. {reattach_hint(job_id, deployment)}")


def parse_overrides(items: list[str]) -> dict[str, Any]:
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"--set {item!r}: expected KEY=VALUE, e.g. data.micro_batches=4")
        try:  # guarded: a value like `&a [*a]` or `{` is the user's typo, not a reason for a traceback
            overrides[key] = load_yaml_text(value, f"--set {key}")
        except YamlInputError as exc:
            typer.echo(f"invalid --set value\n{exc}", err=True)  # plain text: it quotes the user's input
            raise typer.Exit(2) from None
    return overrides


@app.command("submit")
def submit(
    spec: Path = typer.Argument(..., help="The job spec (YAML)."),
    deployment: Path = typer.Option(
        None,
        help="A run directory, its deployment.json or an endpoints file (default: the current context's, "
        "`nebula login`).",
    ),
    credentials: Path = typer.Option(
        None,
        help="YAML {cluster: {username, password}} (default: the account `nebula login` keeps for this "
        "deployment).",
    ),
    new_account: bool = typer.Option(
        False,
        "--new-account",
        help="With no login and no --credentials: create an account in each cluster through its admin "
        "(stored in credentials/ beside the deployment), as the demo does.",
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
    detach: bool = typer.Option(
        False, "--detach", help="Submit, print the job id and how to follow it, and return (the job runs on)."
    ),
) -> None:
    """Validate the spec and its modules, then run each stage in its cluster and follow the job."""
    if resume and hot_start_steps:
        raise typer.BadParameter("--resume and --hot-start-steps are exclusive: a job starts from one state")
    from nebula_common.jobspec import SpecError, load_spec  # pydantic models: built only to submit

    try:
        loaded = load_spec(spec, parse_overrides(overrides))
    except SpecError as exc:  # plain text on stderr: the message quotes the user's input (no markup)
        typer.echo(f"invalid job spec\n{exc}", err=True)
        raise typer.Exit(2) from None
    try:  # read before anything is created: a broken file is refused up front, like a bad spec
        deployment, identity, _ = resolve_identity(deployment, credentials)
        given = read_credentials(identity)
    except DeploymentFileError as exc:
        typer.echo(f"invalid --credentials file or context\n{exc}", err=True)
        raise typer.Exit(2) from None
    if given is None and not new_account:
        with contextlib.suppress(NebulaError, ValueError):  # a bad path is named by the submit below
            target = DeploymentTarget.load(deployment)
            if target.stopped_records() is not None:
                console.print(f"[red]job failed:[/] {stopped_message(target)}")
                raise typer.Exit(1)
        typer.echo(
            f"no account to submit as on {deployment}: `nebula login --deployment {deployment} --username "
            "NAME` once (or --credentials FILE; --new-account creates one through the admins)",
            err=True,
        )
        raise typer.Exit(2)
    if resume and given is None:
        raise typer.BadParameter(
            "--resume needs an account (a login or --credentials): checkpoints belong to the accounts "
            "that made them"
        )
    try:
        if hot_start_steps:
            console.print(f"hot start: training steps 0..{hot_start_steps - 1} unsplit in this process")
            job, local = ProgramJob.hot_started(loaded, hot_start_steps)
            console.print(
                f"hot start: loss {local.losses[0]:.4f} -> {local.losses[-1]:.4f}; continuing split"
            )
        else:
            job = ProgramJob(loaded)
        sessions = sessions_for(deployment, given, set(job.clusters().values()))
        if resume:
            stages = {stage: sessions[cluster] for stage, cluster in job.clusters().items()}
            step = common_checkpoint_step(resume, stages)
            if step is None:
                raise NebulaError(f"no checkpoint of job {resume!r} held by every cluster for these accounts")
            job = ProgramJob(loaded, resume_job_id=resume, resume_step=step)
        console.print(f"job [bold]{job.job_id}[/]: stages {job.clusters()}")
        link = DeploymentTarget.load(deployment).link  # a run directory, deployment.json or endpoints
        if link_mbit is not None or link_rtt_ms is not None:
            link = LinkProfile(
                bandwidth_mbit=link_mbit
                if link_mbit is not None
                else (link.bandwidth_mbit if link else 60.0),
                rtt_ms=link_rtt_ms if link_rtt_ms is not None else (link.rtt_ms if link else 40.0),
            )
        if detach:
            print_placements(job, submit_job(job, sessions, link=link))
            console.print(f"job {job.job_id} submitted; it runs on. {reattach_hint(job.job_id, deployment)}")
            if json_path is not None:
                json_path.write_text(json.dumps({"job_id": job.job_id, "detached": True}, indent=2))
            return
        try:
            summary = follow(job, sessions, link=link)
        except KeyboardInterrupt:
            interrupted(job.job_id, sessions, deployment)
            raise typer.Exit(130) from None
    except (NebulaError, ValueError) as exc:
        console.print(f"[red]job failed:[/] {exc}")
        raise typer.Exit(1) from exc
    print_summary(summary)
    if json_path is not None:
        json_path.write_text(json.dumps(summary.to_json(), indent=2))
        console.print(f"summary written to {json_path}")
    if not summary.succeeded:
        raise typer.Exit(1)
