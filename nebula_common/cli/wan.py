"""``nebula wan`` commands: stand up an emulated WAN link between two switches by hand or in CI."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from nebula_common.wan.emulator import LinkShape, parse_address, run_emulator_forever

app = typer.Typer(help="Emulated WAN link between two switches.", no_args_is_help=True)


@app.callback()
def _group() -> None:
    # Without a callback Typer collapses a one-command app into that command, which would make
    # the standalone app and the registered ``nebula wan emulate`` sub-command disagree.
    pass


def _check_listen(value: str) -> str:
    try:
        parse_address(value, "listen address", allow_port_zero=True)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return value


def _check_target(value: str) -> str:
    try:
        parse_address(value, "target address")
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return value


def _check_bandwidth(value: float) -> float:
    # Reuse LinkShape's rules so the CLI and the library can never disagree on what is valid.
    try:
        LinkShape(bandwidth_mbit=value, delay_ms=0.0)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return value


def _check_delay(value: float) -> float:
    try:
        LinkShape(bandwidth_mbit=1.0, delay_ms=value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return value


@app.command()
def emulate(
    target: Annotated[
        str, typer.Option(help="HOST:PORT of the far switch to forward to.", callback=_check_target)
    ],
    listen: Annotated[
        str, typer.Option(help="HOST:PORT to accept the near switch on.", callback=_check_listen)
    ] = "127.0.0.1:7000",
    bandwidth_mbit: Annotated[
        float, typer.Option(help="Link bandwidth per direction, Mbit/s.", callback=_check_bandwidth)
    ] = 60.0,
    delay_ms: Annotated[
        float, typer.Option(help="One-way propagation delay, ms.", callback=_check_delay)
    ] = 20.0,
) -> None:
    """Forward LISTEN to TARGET through a shaped link until interrupted (Ctrl-C / SIGTERM)."""
    shape = LinkShape(bandwidth_mbit=bandwidth_mbit, delay_ms=delay_ms)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    typer.echo(
        f"Emulating WAN link {listen} -> {target}: {bandwidth_mbit:g} Mbit/s and {delay_ms:g} ms "
        "one-way delay in each direction (Ctrl-C to stop)"
    )
    try:
        run_emulator_forever(target=target, listen=listen, shape=shape)
    except OSError as exc:
        # Target problems are per-connection and only logged, so an OSError here means the bind failed.
        typer.echo(f"Error: cannot listen on {listen}: {exc}", err=True)
        raise typer.Exit(code=1) from None
