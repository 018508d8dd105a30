"""One real two-cluster deployment (separate processes, emulated WAN) shared by the integration tests."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nebula_common.launcher import LocalDeployment
from nebula_common.sdk.auth_client import AuthClient
from nebula_common.sdk.client import ClusterSession


@pytest.fixture(scope="session")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    run_dir: Path = tmp_path_factory.mktemp("nebula-run")
    with LocalDeployment(run_dir=run_dir, bandwidth_mbit=100.0, delay_ms=5.0) as running:
        yield running


def make_user(deployment: LocalDeployment, cluster: str, username: str) -> tuple[ClusterSession, str]:
    """Create an account in ``cluster`` through its admin and log it in; returns (session, password)."""
    endpoints = deployment.endpoints(cluster)
    password = secrets.token_urlsafe(16)
    with AuthClient(endpoints.auth) as auth:
        admin = auth.login("admin", deployment.cluster_state[cluster].admin_password)
        auth.create_account(admin.token, username, password)
    return ClusterSession.login(endpoints, username, password), password


@pytest.fixture(scope="session")
def new_user(deployment: LocalDeployment) -> Callable[[str, str], ClusterSession]:
    """Factory fixture: ``new_user(cluster, username) -> ClusterSession`` for a fresh account."""
    return lambda cluster, username: make_user(deployment, cluster, username)[0]


@pytest.fixture(scope="session")
def sessions(deployment: LocalDeployment) -> dict[str, ClusterSession]:
    return {"a": make_user(deployment, "a", "alice")[0], "b": make_user(deployment, "b", "bob")[0]}
