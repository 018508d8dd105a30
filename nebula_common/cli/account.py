"""`nebula account`: the accounts of a deployment's clusters, managed by their admins.

Why a command of its own: accounts are the unit of ownership in Nebula (jobs, checkpoints, datasets,
grants all belong to one), and until now they were created invisibly with passwords nobody saw. Here
every account operation goes through each cluster's own auth service with an admin's token (the
bootstrap admin of a `nebula local up` run directory by default, or ``--as NAME``); the auth service
refuses anyone else, and that refusal is shown as such. A password this command generates is printed
once and kept in ``<run dir>/credentials/<name>.yaml`` (0600; see ``nebula_common/credentials.py``),
in the shape ``nebula job submit --credentials`` reads.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import typer

from nebula_common.clients.auth import AccountInfo, AuthClient
from nebula_common.clients.data import DataClient
from nebula_common.credentials import CredentialsError, read_passwords, store_new, store_rotated
from nebula_common.errors import NebulaError, PermissionDeniedError
from nebula_common.sdk.deployment import trust_described_cluster

app = typer.Typer(help="Manage the accounts of a deployment's clusters (admins only).", no_args_is_help=True)
LOOPBACK = "127.0.0.1"
ADMIN = "admin"
PASSWORD_ENV = "NEBULA_PASSWORD"
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
_T = TypeVar("_T")


class AccountCommandError(NebulaError):
    """A usage or deployment-file problem; the message names the option or file."""


@dataclass(frozen=True)
class ClusterTarget:
    cluster: str
    auth: str
    data: str
    admin_password_file: Path


@dataclass(frozen=True)
class Deployment:
    run_dir: Path
    clusters: dict[str, ClusterTarget]

    def select(self, names: list[str]) -> list[ClusterTarget]:
        unknown = sorted(set(names) - set(self.clusters))
        if unknown:
            raise AccountCommandError(
                f"--cluster {', '.join(unknown)}: not in this deployment (it has {', '.join(self.clusters)})"
            )
        return [self.clusters[name] for name in (names or sorted(self.clusters))]


def load_deployment(run_dir: Path | None, deployment: Path | None) -> Deployment:
    """The clusters of a `nebula local up` deployment, from its deployment.json."""
    if deployment is not None and run_dir is None:
        path = deployment
    elif run_dir is not None and deployment is None:
        path = run_dir / "deployment.json"
    else:
        raise AccountCommandError("give exactly one of --run-dir DIR or --deployment FILE")
    try:
        description = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise AccountCommandError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise AccountCommandError(f"{path}: not a deployment description (JSON): {exc}") from None
    try:
        clusters = {}
        for cluster, entry in description["clusters"].items():
            processes = entry["processes"]
            trust_described_cluster(cluster, entry)  # its internal ports' CA
            clusters[cluster] = ClusterTarget(
                cluster=cluster,
                auth=f"{LOOPBACK}:{int(processes[f'auth-{cluster}']['grpc_port'])}",
                data=f"{LOOPBACK}:{int(processes[f'data-{cluster}']['grpc_port'])}",
                admin_password_file=Path(entry["admin_password_file"]),
            )
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise AccountCommandError(f"{path}: deployment description is missing or has a bad {exc}") from None
    if not clusters:
        raise AccountCommandError(f"{path}: the deployment has no clusters")
    return Deployment(run_dir=path.parent, clusters=clusters)  # credentials go beside deployment.json


def acting_password(target: ClusterTarget, acting: str, run_dir: Path) -> str:
    """The password of the account this command acts as, in ``target``'s cluster."""
    if acting == ADMIN:
        try:
            return target.admin_password_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise AccountCommandError(
                f"cannot read cluster {target.cluster}'s admin password {target.admin_password_file}: "
                f"{exc.strerror or exc}"
            ) from None
    if os.environ.get(PASSWORD_ENV):
        return os.environ[PASSWORD_ENV]
    stored = read_passwords(run_dir, acting).get(target.cluster)
    if stored:
        return stored
    return typer.prompt(f"password of {acting} in cluster {target.cluster}", hide_input=True)


@contextmanager
def acting_session(target: ClusterTarget, acting: str, run_dir: Path) -> Iterator[tuple[AuthClient, str]]:
    """An auth client of ``target`` and a token of the acting account."""
    with AuthClient(target.auth) as auth:
        password = acting_password(target, acting, run_dir)
        token = in_cluster(target, f"logging in as {acting!r}", lambda: auth.login(acting, password)).token
        yield auth, token


def in_cluster(target: ClusterTarget, action: str, call: Callable[[], _T]) -> _T:
    """Run ``call``; a refusal names the cluster and, for a permission error, who may do it."""
    try:
        return call()
    except PermissionDeniedError as exc:
        raise PermissionDeniedError(
            f"cluster {target.cluster}: {action} refused: only an admin of the cluster may ({exc})"
        ) from None
    except NebulaError as exc:
        raise type(exc)(f"cluster {target.cluster}: {action} failed: {exc}") from None


def new_password() -> str:
    return secrets.token_urlsafe(18)  # 24 characters, 144 bits


def emit(as_json: bool, data: Any, lines: list[str]) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=True) if as_json else "\n".join(lines))


def fail(exc: Exception, code: int = 1) -> typer.Exit:
    typer.echo(f"Error: {exc}", err=True)
    return typer.Exit(code)


def account_json(target: ClusterTarget, info: AccountInfo) -> dict[str, Any]:
    return {**asdict(info), "cluster_id": target.cluster}


# Options shared by every command.
RunDir = typer.Option(None, help="Run directory of a `nebula local up` (its deployment.json).")
DeploymentFile = typer.Option(None, "--deployment", help="A deployment.json (instead of --run-dir).")
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
    try:
        target_deployment = load_deployment(run_dir, deployment)
        targets = target_deployment.select(clusters)
        folder = target_deployment.run_dir
        if read_passwords(folder, username):
            raise AccountCommandError(
                f"credentials of {username!r} already exist in {folder / 'credentials'}; nothing was created"
            )
    except (NebulaError, CredentialsError) as exc:
        raise fail(exc, 2) from None
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
    try:
        target_deployment = load_deployment(run_dir, deployment)
        targets = target_deployment.select(clusters)
        rows: list[dict[str, Any]] = []
        for target in targets:
            with acting_session(target, acting, target_deployment.run_dir) as (auth, token):
                accounts = in_cluster(target, "listing accounts", lambda a=auth, t=token: a.list_accounts(t))
            rows += [account_json(target, info) for info in sorted(accounts, key=lambda i: i.username)]
    except AccountCommandError as exc:
        raise fail(exc, 2) from None
    except NebulaError as exc:
        raise fail(exc) from None
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
    try:
        target_deployment = load_deployment(run_dir, deployment)
        rows = []
        for target in target_deployment.select(clusters):
            with acting_session(target, acting, target_deployment.run_dir) as (auth, token):
                change = auth.enable_account if enable else auth.disable_account
                info = in_cluster(target, f"{verb} {username!r}", lambda c=change, t=token: c(t, username))
            rows.append(account_json(target, info))
    except AccountCommandError as exc:
        raise fail(exc, 2) from None
    except NebulaError as exc:
        raise fail(exc) from None
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
    try:
        target_deployment = load_deployment(run_dir, deployment)
        targets = target_deployment.select(clusters)
    except (NebulaError, CredentialsError) as exc:
        raise fail(exc, 2) from None
    folder = target_deployment.run_dir
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
    with AuthClient(target.auth) as auth:
        token = auth.login(username, password).token
    with DataClient(target.data, token) as data:
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
    try:
        target_deployment = load_deployment(run_dir, deployment)
        folder = target_deployment.run_dir
        own_passwords = read_passwords(folder, username)
        rows = []
        for target in target_deployment.select(clusters):
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
    except (AccountCommandError, CredentialsError) as exc:
        raise fail(exc, 2) from None
    except NebulaError as exc:
        raise fail(exc) from None
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
