"""`nebula codec`: inspect codec specs and ask for advice.

The codec benchmark is not a command of the installed CLI: it trains a built-in job, so it lives
with the other benchmarks in the source tree (``make bench``, ``bench/codecs/benchmark.py``).
"""

from __future__ import annotations

import json
import os

import typer
from rich.table import Table

from nebula_common.cli.console import new_console

# The codec package imports torch: each command imports what it uses, so `nebula --help` stays fast.

app = typer.Typer(help="Codec specs and advice.", no_args_is_help=True)
console = new_console()


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(part) for part in text.replace("x", ",").split(",") if part.strip())
    except ValueError:
        raise typer.BadParameter(f"shape must be comma-separated integers, got {text!r}") from None
    if any(dim < 0 for dim in dims):
        raise typer.BadParameter(f"shape {text!r} has a negative dimension")
    return dims


@app.command("list")
def list_codecs(
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list instead of one name per line."),
) -> None:
    """Registered codec names (wire codecs and stream options)."""
    from nebula_common.codec import available_codecs

    names = list(available_codecs())
    if as_json:
        typer.echo(json.dumps(names))
        return
    for name in names:
        console.print(name)


@app.command("inspect")
def inspect_spec(
    spec: str = typer.Argument(..., help="Codec spec, e.g. 'fp16(svd(0.6))' or 'start(ef(int8),1000)'."),
    shape: str = typer.Option("64,12,128", help="Tensor shape, e.g. 64,12,128."),
    dtype: str = typer.Option("float32", help="Tensor dtype."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of text."),
) -> None:
    """Canonical spelling, exact encoded size and ratio for a shape, and any fallback note."""
    import torch

    from nebula_common.codec import CodecError, canonical_spec, get_codec
    from nebula_common.codec.base import dtype_from_name, numel

    try:
        canonical = canonical_spec(spec)
        torch_dtype = dtype_from_name(dtype)
    except CodecError as exc:
        raise typer.BadParameter(str(exc)) from exc
    dims = _shape(shape)
    codec = get_codec(canonical)
    while not codec.wire and getattr(codec, "inner", None) is not None:
        codec = codec.inner  # type: ignore[attr-defined]
    if not codec.wire:
        if as_json:
            typer.echo(json.dumps({"canonical": canonical, "wire_codec": None, "resolved_at": "job start"}))
            return
        console.print(f"canonical: {canonical}")
        console.print("auto is resolved by the codec service's Advise at job start")
        return
    raw = numel(dims) * torch.empty((), dtype=torch_dtype).element_size()
    size = codec.encoded_size(dims, torch_dtype)
    kind = "at most" if codec.variable_size else "exactly"
    ratio = size / raw if raw else 0.0
    note = codec.plan_note(dims, torch_dtype)
    if as_json:
        body = {
            "canonical": canonical,
            "wire_codec": codec.spec,
            "shape": list(dims),
            "dtype": dtype,
            "raw_bytes": raw,
            "encoded_bytes": size,
            "variable_size": bool(codec.variable_size),
            "ratio": ratio,
            "note": note or "",
        }
        typer.echo(json.dumps(body, indent=2))
        return
    console.print(f"canonical: {canonical}")
    console.print(
        f"wire codec {codec.spec}: {kind} {size} bytes for {list(dims)} {dtype} ({raw} raw), "
        f"ratio {ratio:.4f}"
    )
    if note:
        console.print(f"[yellow]{note}[/]")


def _login(auth: str, user: str) -> str:
    """A token for the codec service, which refuses calls without one."""
    if not auth or not user:
        raise typer.BadParameter("--address needs --auth and --user (the codec service checks tokens)")
    from nebula_common.errors import NebulaError
    from nebula_common.sdk.auth_client import AuthClient

    password = os.environ.get("NEBULA_PASSWORD") or typer.prompt(f"password for {user}", hide_input=True)
    try:
        with AuthClient(auth) as client:
            return client.login(user, password).token
    except NebulaError as exc:
        console.print(f"[red]login to {auth} as {user} failed: {exc}[/]")
        raise typer.Exit(1) from None


@app.command("advise")
def advise_command(
    shape: str = typer.Option("64,12,128", help="Activation shape per micro-batch (gradients match it)."),
    bandwidth_mbit: float = typer.Option(60.0, min=0.001, help="Link bandwidth per direction (Mbit/s)."),
    rtt_ms: float = typer.Option(40.0, min=0.0, help="Round-trip time (ms)."),
    micro_batches: int = typer.Option(2, min=1, help="Micro-batches per step."),
    compute_ms: float = typer.Option(0.0, min=0.0, help="Compute time per micro-batch (ms)."),
    error_budget: float = typer.Option(
        0.0, min=0.0, help="Max relative L2 error (0: per-direction defaults)."
    ),
    address: str = typer.Option(
        "", help="Ask this codec service (host:port) instead of calibrating locally."
    ),
    auth: str = typer.Option("", help="With --address: host:port of the same cluster's auth service."),
    user: str = typer.Option("", help="With --address: your account there (password: $NEBULA_PASSWORD)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """Rank codec specs for a link and tensor shape by predicted step time."""
    from nebula_common.codec import CodecError
    from nebula_common.codec.advice import advise, job_advice_request
    from nebula_common.codec.calibration import Calibrator, default_cache_path

    request = job_advice_request(
        bandwidth_bps=bandwidth_mbit * 1e6,
        rtt_seconds=rtt_ms / 1e3,
        edge="encoder->decoder",
        activation_shape=_shape(shape),
        micro_batches=micro_batches,
        compute_seconds=compute_ms / 1e3,
        error_budget=error_budget,
    )
    try:
        if address:
            from nebula_common.codec.advice_client import advise_specs_sync

            result = advise_specs_sync(address, request, token=_login(auth, user))
        else:
            calibrator = Calibrator(default_cache_path())
            calibrator.start()
            result = advise(request, calibrator)
    except CodecError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if json_out:
        console.print_json(json.dumps(_result_json(result)))
        return
    for direction in result.directions:
        table = Table(
            title=f"{direction.edge} {direction.direction} {list(direction.shape)} "
            f"({direction.error_source} error)"
        )
        for column in ("spec", "ratio", "rel. error", "encode ms", "decode ms", "wire ms", "per step ms"):
            table.add_column(column, justify="right" if column != "spec" else "left")
        for option in direction.options:
            table.add_row(
                option.spec if option.within_budget else f"[dim]{option.spec} (over budget)[/]",
                f"{option.ratio:.4f}",
                f"{option.rel_error:.4f}",
                f"{option.encode_seconds * 1e3:.2f}",
                f"{option.decode_seconds * 1e3:.2f}",
                f"{option.transfer_seconds * 1e3:.2f}",
                f"{option.direction_seconds * 1e3:.2f}",
            )
        console.print(table)
    console.print(
        f"predicted step {result.predicted_step_seconds * 1e3:.1f} ms with "
        f"{result.forward_spec} + {result.backward_spec} (none: {result.baseline_step_seconds * 1e3:.1f} ms)"
    )


def _result_json(result: object) -> dict[str, object]:
    from dataclasses import asdict

    return asdict(result)  # type: ignore[call-overload]
