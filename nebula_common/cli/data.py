"""``nebula data``: an account's datasets on its cluster's data service, and grants to other accounts.

Every command acts as one account of one cluster: ``--address`` is that cluster's data service,
``--auth`` its auth service, ``--user`` the account; the password comes from ``NEBULA_PASSWORD``
or a prompt (never a flag, so it stays out of shell history and ``ps``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer
from rich.table import Table

from nebula_common.cli.console import new_console, print_error
from nebula_common.errors import NebulaError
from nebula_common.sdk.auth_client import AuthClient
from nebula_common.sdk.data_client import DataClient, DatasetInfo

T = TypeVar("T")

app = typer.Typer(help="Datasets in your own namespace, and grants that let others read batches.")
console = new_console()

Address = Annotated[str, typer.Option("--address", help="host:port of the cluster's data service.")]
Auth = Annotated[str, typer.Option("--auth", help="host:port of the same cluster's auth service.")]
User = Annotated[str, typer.Option("--user", help="Your account on that cluster.")]


def _client(address: str, auth: str, user: str) -> DataClient:
    password = os.environ.get("NEBULA_PASSWORD") or typer.prompt(f"password for {user}", hide_input=True)
    try:
        with AuthClient(auth) as client:
            token = client.login(user, password).token
    except NebulaError as exc:
        raise _fail(f"login to {auth} as {user} failed: {exc}") from None
    return DataClient(address, token)


def _call(address: str, auth: str, user: str, operation: Callable[[DataClient], T]) -> T:
    """Log in, run one data-service call, and turn a refusal into a clear error and exit code 1."""
    with _client(address, auth, user) as client:
        try:
            return operation(client)
        except NebulaError as exc:
            raise _fail(str(exc)) from None


def _fail(message: str) -> typer.Exit:
    print_error(message)
    return typer.Exit(code=1)


def _show(datasets: list[DatasetInfo], title: str) -> None:
    table = Table(title=title)
    for column in ("dataset", "records", "bytes", "sha256"):
        table.add_column(column)
    for d in datasets:
        table.add_row(d.ref, str(d.records), str(d.size_bytes), d.sha256[:16])
    console.print(table)


@app.command()
def upload(
    name: Annotated[str, typer.Argument(help="Name of the new dataset.")],
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="Local JSON Lines file.")],
    address: Address,
    auth: Auth,
    user: User,
) -> None:
    """Upload a JSON Lines file (one JSON value per line) as a new dataset of yours."""
    info = _call(address, auth, user, lambda c: c.upload_file(name, file))
    console.print(f"{info.ref}: {info.records} records, sha256 {info.sha256}")


@app.command("import")
def import_(
    name: Annotated[str, typer.Argument(help="Name of the new dataset.")],
    inbox_path: Annotated[str, typer.Argument(help="File in your inbox on the data service's host.")],
    address: Address,
    auth: Auth,
    user: User,
) -> None:
    """Create a dataset from a file already in your inbox (<data dir>/accounts/<you>/inbox/)."""
    info = _call(address, auth, user, lambda c: c.import_file(name, inbox_path))
    console.print(f"{info.ref}: {info.records} records, sha256 {info.sha256}")


@app.command("list")
def list_(address: Address, auth: Auth, user: User) -> None:
    """Your datasets, and the datasets other accounts granted you."""
    owned, granted = _call(address, auth, user, lambda c: c.list())
    _show(owned, "yours")
    _show(granted, "granted to you")


@app.command()
def delete(
    dataset: Annotated[str, typer.Argument(help="NAME of one of your datasets.")],
    address: Address,
    auth: Auth,
    user: User,
) -> None:
    """Delete one of your datasets and every grant on it."""
    _call(address, auth, user, lambda c: c.delete(dataset))
    console.print(f"deleted {dataset}")


@app.command()
def download(
    dataset: Annotated[str, typer.Argument(help="NAME of one of your datasets.")],
    out: Annotated[Path, typer.Argument(help="Where to write the JSON Lines file.")],
    address: Address,
    auth: Auth,
    user: User,
) -> None:
    """Download one of YOUR datasets (grantees read batches only)."""
    size = _call(address, auth, user, lambda c: c.download(dataset, out))
    console.print(f"wrote {size} bytes to {out}")


@app.command()
def grant(
    name: Annotated[str, typer.Argument(help="NAME of one of your datasets.")],
    grantee: Annotated[str, typer.Argument(help="Account of this cluster that may read batches of it.")],
    address: Address,
    auth: Auth,
    user: User,
    expires_at: Annotated[int, typer.Option(min=0, help="Unix time the grant ends; 0: until revoked.")] = 0,
) -> None:
    """Let another account's stages read batches of your dataset (never the file)."""
    info = _call(address, auth, user, lambda c: c.grant(name, grantee, expires_at))
    console.print(f"granted {info.owner}/{info.name} to {info.grantee}")


@app.command()
def revoke(
    name: Annotated[str, typer.Argument(help="NAME of one of your datasets.")],
    grantee: Annotated[str, typer.Argument(help="Account whose grant ends (its next batch is refused).")],
    address: Address,
    auth: Auth,
    user: User,
) -> None:
    """Withdraw a grant; takes effect on the grantee's next batch."""
    revoked = _call(address, auth, user, lambda c: c.revoke(name, grantee))
    console.print(f"revoked {grantee}" if revoked else f"{grantee} held no grant on {name}")


@app.command()
def grants(
    dataset: Annotated[str, typer.Argument(help="NAME of one of your datasets.")],
    address: Address,
    auth: Auth,
    user: User,
) -> None:
    """Who may currently read batches of your dataset."""
    current = _call(address, auth, user, lambda c: c.grants(dataset))
    for g in current:
        console.print(
            f"{g.grantee}\tsince {g.granted_at}\t{'until ' + str(g.expires_at) if g.expires_at else ''}"
        )


@app.command()
def read(
    dataset: Annotated[str, typer.Argument(help="OWNER/NAME (granted) or NAME (yours).")],
    ids: Annotated[str, typer.Argument(help="Comma-separated example ids, e.g. 0,5,9.")],
    address: Address,
    auth: Auth,
    user: User,
) -> None:
    """Print records by example id, one JSON document per line (what a stage's batch receives)."""
    try:
        wanted = [int(part) for part in ids.split(",") if part.strip()]
    except ValueError:
        raise _fail(f"ids {ids!r} must be comma-separated non-negative integers") from None
    if not wanted or min(wanted) < 0:
        raise _fail(f"ids {ids!r} must be comma-separated non-negative integers")
    records = _call(address, auth, user, lambda c: c.read_batch_json(dataset, wanted))
    for record in records:
        typer.echo(record)
