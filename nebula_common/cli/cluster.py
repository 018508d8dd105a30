"""`nebula cluster up`: one organisation's cluster, its switch pointed at its peer organisation(s)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from nebula_common.cli.console import new_console
from nebula_common.cli.local import _print_event, serve_until_stopped
from nebula_common.launcher.addresses import ClusterDeploymentError, parse_host_port, parse_peer
from nebula_common.launcher.organisation import ClusterDeployment
from nebula_common.launcher.supervisor import RestartPolicy
from nebula_common.pki.identity import validate_cluster_id

app = typer.Typer(help="Run one organisation's cluster.", no_args_is_help=True)
console = new_console()


def _cluster(value: str) -> str:
    try:
        return validate_cluster_id(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _peers(values: list[str]) -> list[str]:
    try:
        ids = [parse_peer(value)[0] for value in values]
    except ClusterDeploymentError as exc:
        raise typer.BadParameter(str(exc)) from None
    if len(set(ids)) != len(ids):
        raise typer.BadParameter(f"each peer once, got {', '.join(ids)}")
    return values


def _host_port(value: str) -> str:
    try:
        return parse_host_port(value, "--wan-listen")
    except ClusterDeploymentError as exc:
        raise typer.BadParameter(str(exc)) from None


@app.command("up")
def up(
    cluster: Annotated[str, typer.Option(help="This organisation's cluster id.", callback=_cluster)],
    peer: Annotated[
        list[str],
        typer.Option(
            help="A peer organisation: 'b=HOST:PORT' (its WAN port) or just 'b' to only accept its link. "
            "Repeat it per peer of a chain across more clusters (--peer b=HOST:PORT --peer c=HOST:PORT).",
            callback=_peers,
        ),
    ],
    run_dir: Annotated[Path, typer.Option(help="State, logs and (by default) the PKI of this cluster.")],
    wan_listen: Annotated[
        str,
        typer.Option(
            help="Where the switch's WAN port listens (open this one port to the peer).", callback=_host_port
        ),
    ] = "0.0.0.0:7443",
    pki_dir: Annotated[
        Path | None, typer.Option(help="PKI root (default RUN_DIR/pki), from `nebula pki init --cluster`.")
    ] = None,
    max_restarts: Annotated[
        int, typer.Option(min=0, help="Give up on a service that dies more often than this within a minute.")
    ] = 5,
    share: Annotated[
        list[Path] | None,
        typer.Option(
            help="A folder the trainer reads (read-only) besides its own, e.g. pre-trained weights a job "
            "names by absolute path; repeatable. A boxed trainer sees nothing else of this machine."
        ),
    ] = None,
) -> None:
    """Start this cluster's auth, codec, data, switch and trainer until interrupted.

    Needs this cluster's PKI trusting the peer (`nebula pki init --cluster`, `pki trust add`); the peer's
    CRL arrives over the WAN port. The cluster whose id sorts first dials the other (it needs the peer's
    address). `nebula local status|down --run-dir` work on the same run directory.
    """
    (peer_id, peer_address), *more_peers = [parse_peer(value) for value in peer]
    for folder in share or []:
        if not folder.is_dir():
            raise typer.BadParameter(f"{folder}: not a directory", param_hint="--share")
    deployment = ClusterDeployment(
        run_dir=run_dir,
        cluster=cluster,
        peer=peer_id,
        peer_address=peer_address,
        more_peers=tuple(more_peers),
        wan_listen=wan_listen,
        pki_dir=pki_dir,
        restart_policy=RestartPolicy(max_restarts=max_restarts),
        on_event=_print_event,
        shares=tuple(share or ()),
    )
    names = ", ".join([peer_id, *(other for other, _ in more_peers)])
    console.print(f"starting cluster {cluster} (peers {names}) in [bold]{escape(str(run_dir))}[/] ...")

    def announce() -> None:
        console.print_json(json.dumps(deployment.describe()))
        console.print(
            f"[green]up[/]: cluster {cluster}, WAN port {wan_listen}, "
            f"logs in {escape(str(deployment.log_dir))}. "
            f"Ctrl-C (or `nebula local down --run-dir {escape(str(run_dir))}`) stops it."
        )

    serve_until_stopped(deployment, run_dir, announce)
