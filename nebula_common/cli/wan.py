"""``nebula wan`` commands: stand up an emulated WAN link between two switches by hand or in CI."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated, Any

import typer

from nebula_common.wan.address import parse_address
from nebula_common.wan.control import WanControl, WanControlError, control_attacher, read_token
from nebula_common.wan.emulator import LinkShape, run_emulator_forever

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


def _check_loss(value: float) -> float:
    try:
        LinkShape(bandwidth_mbit=1.0, delay_ms=0.0, loss=value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return value


def _check_mtu(value: int) -> int:
    try:
        LinkShape(bandwidth_mbit=1.0, delay_ms=0.0, mtu=value)
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
    loss: Annotated[
        float,
        typer.Option(
            help="Probability that a TCP segment is lost (0.001 = 0.1%), modelled Reno-style per connection.",
            envvar="NEBULA_WAN_LOSS",
            callback=_check_loss,
        ),
    ] = 0.0,
    mtu: Annotated[
        int,
        typer.Option(
            help="Link MTU: segments carry MTU-52 payload bytes and 66 header bytes.", callback=_check_mtu
        ),
    ] = 1500,
    seed: Annotated[
        int | None,
        typer.Option(help="Seed of the loss model, for repeatable losses.", envvar="NEBULA_WAN_SEED"),
    ] = None,
    control: Annotated[
        str | None,
        typer.Option(
            help="HOST:PORT (loopback) of a control port for `nebula wan cut|restore|reset|status`.",
            callback=lambda v: _check_listen(v) if v is not None else None,
        ),
    ] = None,
    control_token_file: Annotated[
        Path | None, typer.Option(help="File holding the token control requests must carry.")
    ] = None,
) -> None:
    """Forward LISTEN to TARGET through a shaped link until interrupted (Ctrl-C / SIGTERM).

    The bandwidth is the wire rate of the aggregate of all connections in each direction
    (headers counted per segment), so it can be compared one to one with kernel shaping.
    """
    shape = LinkShape(bandwidth_mbit=bandwidth_mbit, delay_ms=delay_ms, loss=loss, mtu=mtu, seed=seed)
    attach = None
    if control is not None:
        try:
            token = read_token(control_token_file) if control_token_file is not None else None
        except WanControlError as exc:
            typer.echo(f"Error: {exc}", err=True)
            raise typer.Exit(code=2) from None
        attach = control_attacher(control, token)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    typer.echo(
        f"Emulating WAN link {listen} -> {target}: {bandwidth_mbit:g} Mbit/s and {delay_ms:g} ms "
        f"one-way delay in each direction, loss {loss:g}, MTU {mtu}; all connections share the "
        "bandwidth (Ctrl-C to stop)"
    )
    try:
        run_emulator_forever(target=target, listen=listen, shape=shape, attach=attach)
    except OSError as exc:
        # Target problems are per-connection and only logged, so an OSError here means the bind failed.
        typer.echo(f"Error: cannot listen on {listen}: {exc}", err=True)
        raise typer.Exit(code=1) from None


RunDirOption = Annotated[
    Path | None,
    typer.Option(help="Run directory of a running `nebula local up` (reads its deployment.json)."),
]
ControlOption = Annotated[
    str | None, typer.Option(help="HOST:PORT of an emulator's control port (instead of --run-dir).")
]
TokenFileOption = Annotated[Path | None, typer.Option(help="Control token file (with --control).")]


def _control(run_dir: Path | None, control: str | None, token_file: Path | None) -> WanControl:
    """The control client for a running deployment's emulator, or for an explicit control port."""
    if (run_dir is None) == (control is None):
        raise WanControlError("give exactly one of --run-dir (a running `nebula local up`) or --control")
    if control is not None:
        return WanControl.from_token_file(control, token_file)
    assert run_dir is not None
    description = run_dir / "deployment.json"
    try:
        wan = json.loads(description.read_text())["wan_emulator"]
        address, token_path = wan["control"], wan.get("control_token_file")
    except FileNotFoundError:
        raise WanControlError(
            f"{description} not found: is `nebula local up --run-dir {run_dir}` running?"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WanControlError(f"{description} names no WAN emulator control port ({exc!r})") from None
    return WanControl.from_token_file(address, Path(token_path) if token_path else None)


def _run(action: str, run_dir: Path | None, control: str | None, token_file: Path | None) -> None:
    try:
        client = _control(run_dir, control, token_file)
        result: Any
        if action == "cut":
            result = client.cut()
        elif action == "restore":
            result = client.restore()
        elif action == "reset":
            result = {"reset": client.reset_connections(), **client.status()}
        else:
            result = client.status()
    except WanControlError as exc:
        typer.echo(f"Error: {exc}", err=True)
        raise typer.Exit(code=1) from None
    typer.echo(json.dumps(result, indent=2))


@app.command()
def cut(
    run_dir: RunDirOption = None, control: ControlOption = None, token_file: TokenFileOption = None
) -> None:
    """Cut the emulated WAN both ways: connections stay open, nothing passes, until `restore`."""
    _run("cut", run_dir, control, token_file)


@app.command()
def restore(
    run_dir: RunDirOption = None, control: ControlOption = None, token_file: TokenFileOption = None
) -> None:
    """End a cut: held bytes and held connections continue."""
    _run("restore", run_dir, control, token_file)


@app.command()
def reset(
    run_dir: RunDirOption = None, control: ControlOption = None, token_file: TokenFileOption = None
) -> None:
    """RST every connection the emulator carries (a middlebox losing its state); it keeps listening."""
    _run("reset", run_dir, control, token_file)


@app.command()
def status(
    run_dir: RunDirOption = None, control: ControlOption = None, token_file: TokenFileOption = None
) -> None:
    """Whether the emulated link is cut, its connections and byte counters (JSON)."""
    _run("status", run_dir, control, token_file)


if __name__ == "__main__":
    # `python -m nebula_common.cli.wan emulate ...` (the local launcher's emulator) is `nebula wan emulate`
    # without importing the rest of the CLI (torch among it: about a second of every emulator start).
    app()
