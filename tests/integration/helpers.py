"""Helpers shared by integration tests that drive a real deployment."""

from __future__ import annotations

import secrets

from nebula_common.launcher import LocalDeployment
from nebula_common.sdk.auth_client import AuthClient
from nebula_common.sdk.client import ClusterSession


def make_user(deployment: LocalDeployment, cluster: str, username: str) -> ClusterSession:
    """Create an account in ``cluster`` through that cluster's admin and log it in."""
    endpoints = deployment.endpoints(cluster)
    password = secrets.token_urlsafe(16)
    with AuthClient(endpoints.auth) as auth:
        admin = auth.login("admin", deployment.cluster_state[cluster].admin_password)
        auth.create_account(admin.token, username, password)
    return ClusterSession.login(endpoints, username, password)
