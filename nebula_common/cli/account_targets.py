"""Which clusters an account command acts on, and as whom: the targets and sessions of ``nebula account``.

A deployment is read as ``nebula job`` reads it (``DeploymentTarget.load``); the acting account's
password comes from the cluster's admin password file, ``$NEBULA_PASSWORD``, the run directory's
credentials or a prompt; a refusal in a cluster names the cluster and who may do it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import typer

from nebula_common.clients.auth import AuthClient
from nebula_common.credentials import CredentialsError, read_passwords
from nebula_common.errors import NebulaError, PermissionDeniedError
from nebula_common.sdk.deployment import ENDPOINTS, DeploymentFileError, DeploymentTarget

ADMIN = "admin"
PASSWORD_ENV = "NEBULA_PASSWORD"
_T = TypeVar("_T")


class AccountCommandError(NebulaError):
    """A usage or deployment-file problem; the message names the option or file."""


@dataclass(frozen=True)
class ClusterTarget:
    cluster: str
    auth: str
    data: str  # "" when the endpoints file predates the data service's address
    admin_password_file: Path | None  # None when the endpoints file names none
    origin: str  # the file it was read from, for messages

    def data_address(self) -> str:
        """The data service's address, or a message naming the missing key and what writes it."""
        if not self.data:
            raise AccountCommandError(
                f"{self.origin}: clusters.{self.cluster}.data is missing: dataset grants need the cluster's "
                "data service address; endpoints files written before it lack it: write the file again "
                "(`nebula compose endpoints`, or `nebula local up` for a run directory) or add the key"
            )
        return self.data


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
    """The clusters of any deployment, as ``nebula job`` reads them (``DeploymentTarget.load``): a run
    directory, its deployment.json, or an endpoints file (`nebula compose endpoints`, a local run's,
    or one written by hand for a Kubernetes port-forward)."""
    if (run_dir is None) == (deployment is None):
        raise AccountCommandError("give exactly one of --run-dir DIR or --deployment DIR-or-FILE")
    path = Path(deployment if deployment is not None else run_dir)  # type: ignore[arg-type]
    try:
        target = DeploymentTarget.load(path)
    except DeploymentFileError as exc:
        raise AccountCommandError(str(exc)) from None
    origin = str(path / ENDPOINTS if path.is_dir() and "nebula_endpoints" in target.description else path)
    clusters = {
        cluster: ClusterTarget(cluster, endpoints.auth, endpoints.data, admin, origin)
        for cluster, (endpoints, admin) in target.clusters.items()
    }
    if not clusters:
        raise AccountCommandError(f"{path}: the deployment has no clusters")
    return Deployment(run_dir=target.run_dir, clusters=clusters)  # credentials go beside the file


def open_targets(
    run_dir: Path | None, deployment: Path | None, clusters: list[str]
) -> tuple[list[ClusterTarget], Path]:
    """The preamble of every command: the chosen clusters, and the folder their credentials live in."""
    target_deployment = load_deployment(run_dir, deployment)
    return target_deployment.select(clusters), target_deployment.run_dir


@contextmanager
def exits_on_errors() -> Iterator[None]:
    """A usage or deployment-file problem exits 2; a refusal or failure in a cluster exits 1."""
    try:
        yield
    except (AccountCommandError, CredentialsError) as exc:
        raise fail(exc, 2) from None
    except NebulaError as exc:
        raise fail(exc) from None


def acting_password(target: ClusterTarget, acting: str, run_dir: Path) -> str:
    """The password of the account this command acts as, in ``target``'s cluster."""
    if acting == ADMIN:
        if target.admin_password_file is None:
            raise AccountCommandError(
                f"{target.origin}: clusters.{target.cluster} names no admin_password_file "
                "(`nebula compose endpoints` copies it unless --no-admin); act as an admin account of "
                f"your own with --as NAME and ${PASSWORD_ENV}"
            )
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


def fail(exc: Exception, code: int = 1) -> typer.Exit:
    typer.echo(f"Error: {exc}", err=True)
    return typer.Exit(code)
