"""Accounts for tests: the bootstrap admin of an in-process auth server, and users on a deployment."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from nebula_common.launcher import LocalDeployment
from nebula_common.sdk.auth_client import AuthClient
from nebula_common.sdk.client import ClusterSession
from services.auth.config import AuthSettings

ADMIN_PASSWORD = "bootstrap-admin-secret"
"""The admin password every in-process auth server of the unit tests bootstraps with."""


def auth_settings(work: Path, cluster_id: str, **overrides: Any) -> AuthSettings:
    """Settings of an in-process auth server keeping its state in ``work/auth``.

    Writes ``work/admin-password`` (``ADMIN_PASSWORD``) for the bootstrap admin. Argon2 runs at its
    cheapest cost, because these tests exercise the service, not the hash (``test_auth_service``
    keeps the default cost and checks what is stored); ``overrides`` replace any field, e.g.
    ``max_failed_logins=3``.
    """
    password_file = work / "admin-password"
    password_file.write_text(ADMIN_PASSWORD)
    fields: dict[str, Any] = {
        "cluster_id": cluster_id,
        "data_dir": work / "auth",
        "admin_password_file": password_file,
        "metrics_port": -1,
        "argon2_time_cost": 1,
        "argon2_memory_cost_kib": 1024,
    }
    return AuthSettings(**(fields | overrides))


def admin_token(deployment: LocalDeployment, cluster: str) -> str:
    """A fresh token of ``cluster``'s admin (password from the deployment's own state)."""
    with AuthClient(deployment.endpoints(cluster).auth) as auth:
        return auth.login("admin", deployment.cluster_state[cluster].admin_password).token


def create_account(deployment: LocalDeployment, cluster: str, username: str) -> str:
    """Create ``username`` in ``cluster`` through that cluster's admin; returns its random password."""
    password = secrets.token_urlsafe(16)
    with AuthClient(deployment.endpoints(cluster).auth) as auth:
        auth.create_account(admin_token(deployment, cluster), username, password)
    return password


def make_user(deployment: LocalDeployment, cluster: str, username: str) -> ClusterSession:
    """Create an account in ``cluster`` through that cluster's admin and log it in."""
    password = create_account(deployment, cluster, username)
    return ClusterSession.login(deployment.endpoints(cluster), username, password)
