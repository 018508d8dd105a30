"""`nebula account`: the accounts of a deployment's clusters, managed by their admins.

Why a command of its own: accounts are the unit of ownership in Nebula (jobs, checkpoints, datasets,
grants all belong to one), and until now they were created invisibly with passwords nobody saw. Here
every account operation goes through each cluster's own auth service with an admin's token (the
bootstrap admin of a `nebula local up` run directory by default, or ``--as NAME``); the auth service
refuses anyone else, and that refusal is shown as such. A password this command generates is printed
once and kept in ``<folder>/credentials/<name>.yaml`` (0600; see ``nebula_common/credentials.py``),
in the shape ``nebula job submit --credentials`` reads; the folder is the run directory, or the one
holding the deployment.json or endpoints.json that ``--deployment`` names. Any deployment is targeted
as ``nebula job`` targets it (``nebula_common/sdk/deployment.py``): a local run, compose (`nebula
compose endpoints`) or a Kubernetes port-forward; ``grants`` also needs the file's ``data`` address.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict
from pathlib import Path
from typing import Any

import typer

from nebula_common.cli.account_targets import (
    ADMIN,
    PASSWORD_ENV,
    AccountCommandError,
    ClusterTarget,
    acting_password,
    acting_session,
    exits_on_errors,
    fail,
    in_cluster,
    open_targets,
)
from nebula_common.clients.auth import AccountInfo, AuthClient
from nebula_common.clients.data import DataClient
from nebula_common.credentials import CredentialsError, read_passwords, store_new, store_rotated
from nebula_common.errors import NebulaError

app = typer.Typer(help="Manage the accounts of a deployment's clusters (admins only).", no_args_is_help=True)
ROLE_RIGHTS = {
    "admin": [
        "create, list, disable and enable accounts; set any account's password",
        "query this cluster's audit logs (nebula audit query)",
        "see and cancel every account's jobs",
    ],
    "user": [
        "submit jobs, and see, cancel and resume its own jobs and checkpoints",
        "upload, grant and revoke its own datasets; read batches of datasets granted to it",
        "change its own password",
    ],
}


def new_password() -> str:
    return secrets.token_urlsafe(18)  # 24 characters, 144 bits


def emit(as_json: bool, data: Any, lines: list[str]) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=True) if as_json else "\n".join(lines))


def account_json(target: ClusterTarget, info: AccountInfo) -> dict[str, Any]:
    return {**asdict(info), "cluster_id": target.cluster}


# Options shared by every command.
RunDir = typer.Option(None, help="Run directory of a `nebula local up` (its deployment.json).")
DeploymentFile = typer.Option(
    None,
    "--deployment",
    help="The deployment, as for `nebula job`: a run directory, a deployment.json, or an endpoints.json "
    "(`nebula compose endpoints`, or one written for a Kubernetes port-forward).",
)
Clusters = typer.Option([], "--cluster", help="Cluster id; repeat for several (default: every cluster).")
Acting = typer.Option(
    ADMIN,
    "--as",
    help=f"Account to act as (default: the bootstrap admin); password from ${PASSWORD_ENV}, "
    "its credentials file in the run directory, or a prompt.",
)
AsJson = typer.Option(False, "--json", help="Print JSON instead of text.")


@app.command("create")
def create(
    username: str = typer.Argument(..., help="New account name: 3-64 characters of a-z 0-9 . _ -"),
    role: str = typer.Option("user", help="user or admin."),
    run_dir: Path = RunDir,
    deployment: Path = DeploymentFile,
    clusters: list[str] = Clusters,
    acting: str = Acting,
    as_json: bool = AsJson,
) -> None:
    """Create USERNAME in each cluster with a new random password, shown once and stored (0600)."""
    if role not in ROLE_RIGHTS:
        raise fail(AccountCommandError(f"--role {role!r}: use user or admin"), 2)
    with exits_on_errors():
        targets, folder = open_targets(run_dir, deployment, clusters)
        if read_passwords(folder, username):
            raise AccountCommandError(
                f"credentials of {username!r} already exist in {folder / 'credentials'}; nothing was created"
            )
    created: dict[str, str] = {}
    infos: dict[str, dict[str, Any]] = {}
    error: NebulaError | None = None
    for target in targets:
        password = new_password()
        try:
            with acting_session(target, acting, folder) as (auth, token):
                info = in_cluster(
                    target,
                    f"creating account {username!r}",
                    lambda auth=auth, token=token, password=password: auth.create_account(
                        token, username, password, role
                    ),
                )
        except NebulaError as exc:
            error = exc
            break
        created[target.cluster] = password
        infos[target.cluster] = account_json(target, info)
    stored: Path | None = None
    if created:  # at once, before anything else can fail: a created password is never lost
        try:
            stored = store_new(folder, username, created)
        except CredentialsError as exc:  # someone wrote one meanwhile: the passwords are still shown
            error = error or exc
    lines = [
        f"account {username!r} ({role}) created in cluster {c}; password (shown once): {p}"
        for c, p in created.items()
    ]
    if stored is not None:
        lines.append(
            f"stored in {stored} (mode 0600); use it with `nebula job submit --credentials {stored}`"
        )
    data = {
        "username": username,
        "role": role,
        "accounts": {c: {**infos[c], "password": p} for c, p in created.items()},
        "credentials_file": str(stored) if stored else None,
        "error": str(error) if error else None,
    }
    emit(as_json, data, lines)
    if error is not None:
        raise fail(error)


@app.command("list")
def list_accounts(
    run_dir: Path = RunDir,
    deployment: Path = DeploymentFile,
    clusters: list[str] = Clusters,
    acting: str = Acting,
    as_json: bool = AsJson,
) -> None:
    """Every account of each cluster: role, disabled, locked, created."""
    rows: list[dict[str, Any]] = []
    with exits_on_errors():
        targets, folder = open_targets(run_dir, deployment, clusters)
        for target in targets:
            with acting_session(target, acting, folder) as (auth, token):
                accounts = in_cluster(target, "listing accounts", lambda a=auth, t=token: a.list_accounts(t))
            rows += [account_json(target, info) for info in sorted(accounts, key=lambda i: i.username)]
    lines = [f"{'cluster':8} {'account':24} {'role':6} state"]
    for row in rows:
        state = "disabled" if row["disabled"] else ("locked" if row["locked_until"] else "enabled")
        lines.append(f"{row['cluster_id']:8} {row['username']:24} {row['role']:6} {state}")
    emit(as_json, rows, lines)


@app.command("disable")
def disable(
    username: str = typer.Argument(..., help="Account to disable (or enable with --enable)."),
    enable: bool = typer.Option(False, "--enable", help="Enable it again (also clears a lockout)."),
    run_dir: Path = RunDir,
    deployment: Path = DeploymentFile,
    clusters: list[str] = Clusters,
    acting: str = Acting,
    as_json: bool = AsJson,
) -> None:
    """Refuse USERNAME's logins and revoke its tokens (within seconds) in each cluster."""
    verb = "enabling" if enable else "disabling"
    rows = []
    with exits_on_errors():
        targets, folder = open_targets(run_dir, deployment, clusters)
        for target in targets:
            with acting_session(target, acting, folder) as (auth, token):
                change = auth.enable_account if enable else auth.disable_account
                info = in_cluster(target, f"{verb} {username!r}", lambda c=change, t=token: c(t, username))
            rows.append(account_json(target, info))
    state = "enabled" if enable else "disabled"
    emit(as_json, rows, [f"account {username!r} {state} in cluster {row['cluster_id']}" for row in rows])


@app.command("passwd")
def passwd(
    username: str = typer.Argument(..., help="Account whose password is replaced."),
    run_dir: Path = RunDir,
    deployment: Path = DeploymentFile,
    clusters: list[str] = Clusters,
    acting: str = Acting,
    as_json: bool = AsJson,
) -> None:
    """Give USERNAME a new random password in each cluster (shown once, stored 0600); old tokens stop."""
    with exits_on_errors():
        targets, folder = open_targets(run_dir, deployment, clusters)
    changed: dict[str, str] = {}
    error: NebulaError | None = None
    stored: Path | None = None
    for target in targets:
        password = new_password()
        try:
            current = acting_password(target, acting, folder) if acting == username else ""
            with acting_session(target, acting, folder) as (auth, token):
                in_cluster(
                    target,
                    f"setting the password of {username!r}",
                    lambda a=auth, t=token, p=password, c=current: a.change_password(t, username, p, c),
                )
        except NebulaError as exc:
            error = exc
            break
        changed[target.cluster] = password
        stored = store_rotated(folder, username, target.cluster, password)  # at once: never lost
    lines = [f"new password of {username!r} in cluster {c} (shown once): {p}" for c, p in changed.items()]
    if stored is not None:
        lines.append(f"stored in {stored} (mode 0600)")
    data = {
        "username": username,
        "passwords": changed,
        "credentials_file": str(stored) if stored else None,
        "error": str(error) if error else None,
    }
    emit(as_json, data, lines)
    if error is not None:
        raise fail(error)


def data_grants(target: ClusterTarget, username: str, password: str) -> dict[str, Any]:
    """What ``username`` holds and gives in ``target``'s data service, seen with its own token."""
    address = target.data_address()  # before logging in: a file without it is named at once
    with AuthClient(target.auth) as auth:
        token = auth.login(username, password).token
    with DataClient(address, token) as data:
        owned, granted = data.list()
        given = {dataset.name: [g.grantee for g in data.grants(dataset.name)] for dataset in owned}
    return {
        "granted_to_it": sorted(dataset.ref for dataset in granted),
        "its_datasets": {name: sorted(grantees) for name, grantees in sorted(given.items())},
    }


@app.command("grants")
def grants(
    username: str = typer.Argument(..., help="Account to describe."),
    run_dir: Path = RunDir,
    deployment: Path = DeploymentFile,
    clusters: list[str] = Clusters,
    acting: str = Acting,
    as_json: bool = AsJson,
) -> None:
    """USERNAME's role and what it permits, its state, and its dataset grants (both ways) per cluster.

    Dataset grants are visible to the account itself only (the data service has no admin view), so
    they are shown when its password is at hand: its credentials file in the run directory, or
    ``--as USERNAME`` with ``$NEBULA_PASSWORD``.
    """
    rows = []
    with exits_on_errors():
        targets, folder = open_targets(run_dir, deployment, clusters)
        own_passwords = read_passwords(folder, username)
        for target in targets:
            with acting_session(target, acting, folder) as (auth, token):
                if acting == username:
                    info = in_cluster(target, "reading the account", lambda a=auth, t=token: a.verify(t))
                    account: dict[str, Any] = {"username": username, "role": info.role, "disabled": False}
                else:
                    listed = in_cluster(
                        target, "listing accounts", lambda a=auth, t=token: a.list_accounts(t)
                    )
                    found = [i for i in listed if i.username == username]
                    if not found:
                        raise AccountCommandError(f"cluster {target.cluster}: no account {username!r}")
                    account = account_json(target, found[0])
            password = own_passwords.get(target.cluster) or (
                os.environ.get(PASSWORD_ENV) if acting == username else None
            )
            datasets = (
                in_cluster(
                    target, "reading dataset grants", lambda p=password, t=target: data_grants(t, username, p)
                )
                if password and not account["disabled"]
                else None
            )
            rows.append(
                {
                    "cluster_id": target.cluster,
                    "account": account,
                    "may": ROLE_RIGHTS.get(account["role"], []),
                    "datasets": datasets,
                }
            )
    lines = []
    for row in rows:
        lines.append(f"cluster {row['cluster_id']}: {username} ({row['account']['role']})")
        lines += [f"  may {right}" for right in row["may"]]
        if row["datasets"] is None:
            lines.append("  dataset grants: not shown (needs the account's own password)")
        else:
            received = ", ".join(row["datasets"]["granted_to_it"]) or "none"
            lines.append(f"  reads datasets granted to it: {received}")
            for name, grantees in row["datasets"]["its_datasets"].items():
                lines.append(f"  its dataset {name}: readable by {', '.join(grantees) or 'nobody else'}")
    emit(as_json, rows, lines)
