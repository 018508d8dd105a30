"""`nebula login|logout|context`: who the CLI acts as, set once per deployment (``sdk/contexts.py``).

``login`` checks the account against every cluster of the deployment (a real login at each auth
service) before it keeps anything, so a context always names an identity that worked.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from nebula_common.errors import NebulaError
from nebula_common.sdk.contexts import Context, ContextStore, deployment_key
from nebula_common.sdk.deployment import Credentials, DeploymentFileError, DeploymentTarget, read_credentials

app = typer.Typer(
    help="The contexts `nebula login` keeps: list them, switch between them.", no_args_is_help=True
)


def _fail(message: str, code: int = 1) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def login(
    deployment: Path = typer.Option(
        ..., help="The deployment: a run directory, its deployment.json or an endpoints file."
    ),
    username: str = typer.Option(None, help="Your account's name, the same in every cluster."),
    password_stdin: bool = typer.Option(
        False, "--password-stdin", help="Read the password from standard input (else it is asked for)."
    ),
    credentials: Path = typer.Option(
        None, help="YAML {cluster: {username, password}} (`nebula account create` writes one) instead."
    ),
    context: str = typer.Option(None, "--context", help="The context's name (default: directory@user)."),
    as_json: bool = typer.Option(False, "--json", help="Print the new context as JSON."),
) -> None:
    """Log in to every cluster of a deployment once; later `nebula job` commands act as this account."""
    if (username is None) == (credentials is None):
        raise _fail("give --username (the password is asked for) or --credentials FILE", 2)
    try:
        target = DeploymentTarget.load(deployment)
        if credentials is not None:
            given: Credentials = read_credentials(credentials) or {}
        else:
            password = (
                sys.stdin.readline().rstrip("\n")
                if password_stdin
                else typer.prompt("password", hide_input=True)
            )
            given = {c: {"username": username, "password": password} for c in target.clusters}
        unknown = sorted(set(given) - set(target.clusters))
        if unknown or not given:
            raise DeploymentFileError(
                f"the deployment has clusters {sorted(target.clusters)}, the credentials name {sorted(given)}"
            )
        for session in target.login(given).values():  # raises naming why when a login fails
            session.close()
    except (NebulaError, ValueError) as exc:
        raise _fail(str(exc)) from None
    key = deployment_key(deployment)
    first = next(iter(given.values()))["username"]
    saved = Context(context or f"{Path(key).name}@{first}", key, given)
    store = ContextStore()
    try:
        store.save(saved)
    except (NebulaError, OSError) as exc:
        raise _fail(str(exc)) from None
    if as_json:
        typer.echo(json.dumps(saved.to_json(current=True), indent=2))
        return
    accounts = ", ".join(f"{e['username']} in {c}" for c, e in sorted(given.items()))
    typer.echo(f"logged in as {accounts}; context {saved.name} is current ({store.path})")


def logout(
    context: str = typer.Option(None, "--context", help="The context to forget (default: the current one)."),
    as_json: bool = typer.Option(False, "--json", help="Print the forgotten context as JSON."),
) -> None:
    """Forget a context (its stored password with it)."""
    store = ContextStore()
    try:
        name = context or store.current_name()
        if name is None:
            raise DeploymentFileError("no current context to log out of")
        gone = store.remove(name)
    except (NebulaError, OSError) as exc:
        raise _fail(str(exc)) from None
    if as_json:
        typer.echo(json.dumps(gone.to_json(), indent=2))
    else:
        typer.echo(f"logged out: context {gone.name} forgotten")


@app.command("list")
def list_contexts(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Every context: its deployment and accounts (never a password); the current one marked."""
    store = ContextStore()
    try:
        current, contexts = store.current_name(), store.contexts()
    except (NebulaError, OSError) as exc:
        raise _fail(str(exc)) from None
    rows = [c.to_json(current=c.name == current) for c in contexts]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        typer.echo("no contexts: `nebula login --deployment DIR --username NAME`")
    for row in rows:
        mark = "*" if row["current"] else " "
        users = ", ".join(f"{u} in {c}" for c, u in row["accounts"].items())
        typer.echo(f"{mark} {row['name']}  {row['deployment']}  ({users})")


@app.command("use")
def use_context(
    name: str = typer.Argument(..., help="The context to act as from now on."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Make a context the current one."""
    try:
        chosen = ContextStore().use(name)
    except (NebulaError, OSError) as exc:
        raise _fail(str(exc)) from None
    if as_json:
        typer.echo(json.dumps(chosen.to_json(current=True), indent=2))
    else:
        typer.echo(f"context {chosen.name} is current ({chosen.deployment})")


__all__ = ["app", "login", "logout"]
