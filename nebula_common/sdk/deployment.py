"""A running deployment as one object: where its clusters' services are, and whose account to use.

The CLI and the SDK both start from a deployment description (``deployment.json``, written by
``nebula local up`` into its run directory: every process's ports, each cluster's admin password
file, the emulated WAN's shape). This module reads it and logs in: as given accounts
(``credentials``: ``{cluster: {username, password}}`` or a YAML file of that), as each cluster's
admin (who sees every job), or, to submit with nothing else at hand, as a fresh account per
cluster created through that cluster's admin (what an operator onboarding a researcher does).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nebula_common.clients.endpoints import ClusterEndpoints
from nebula_common.errors import NebulaError
from nebula_common.rpc.internal_tls import ClientTls, trust_endpoint
from nebula_common.safe_yaml import YamlInputError, load_yaml_file
from nebula_common.sdk.auth_client import AuthClient
from nebula_common.sdk.client import ClusterSession
from nebula_common.sdk.codec_advice import LinkProfile

LOOPBACK = "127.0.0.1"
DESCRIPTION = "deployment.json"

Credentials = dict[str, dict[str, str]]


class DeploymentFileError(NebulaError):
    """A deployment description or credentials file that cannot be used (the message names it)."""


def trust_described_cluster(cluster: str, entry: dict[str, Any]) -> None:
    """Verify every internal port of ``cluster`` against its CA (the description's ``ca_cert``).

    A description without one (written before internal TLS) leaves the ports unregistered: the
    clients then need ``NEBULA_CA_CERT``, or the development flag for a plaintext deployment.
    """
    ca = entry.get("ca_cert")
    if not ca:
        return
    tls = ClientTls(cluster, Path(ca))
    for info in entry["processes"].values():
        for key in ("grpc_port", "internal_port", "service_port"):
            port = info.get(key)
            if isinstance(port, int) and port > 0:
                trust_endpoint(f"{LOOPBACK}:{port}", tls)


def endpoints_from_description(description: dict[str, Any]) -> dict[str, tuple[ClusterEndpoints, Path]]:
    """Cluster id -> (endpoints, admin password file) from a `nebula local up` deployment.json."""
    result = {}
    try:
        for cluster, entry in description["clusters"].items():
            processes = entry["processes"]
            trust_described_cluster(cluster, entry)
            metrics = {
                name: f"http://{LOOPBACK}:{info['metrics_port']}/metrics"
                for name, info in processes.items()
                if (info.get("metrics_port") or -1) > 0
            }
            endpoints = ClusterEndpoints(
                cluster_id=cluster,
                auth=f"{LOOPBACK}:{processes[f'auth-{cluster}']['grpc_port']}",
                trainer=f"{LOOPBACK}:{processes[f'trainer-{cluster}']['grpc_port']}",
                switch=f"{LOOPBACK}:{processes[f'switch-{cluster}']['internal_port']}",
                metrics=metrics,
                codec=f"{LOOPBACK}:{processes[f'codec-{cluster}']['grpc_port']}",
            )
            result[cluster] = (endpoints, Path(entry["admin_password_file"]))
    except (KeyError, TypeError, AttributeError) as exc:
        raise DeploymentFileError(f"deployment description is missing {exc}") from exc
    return result


def link_from_description(description: dict[str, Any]) -> LinkProfile | None:
    """The emulated WAN's shape from a deployment.json (what `codec: auto` is advised for)."""
    emulator = description.get("wan_emulator")
    if not isinstance(emulator, dict) or "bandwidth_mbit" not in emulator:
        return None
    return LinkProfile(
        bandwidth_mbit=float(emulator["bandwidth_mbit"]), rtt_ms=2 * float(emulator["delay_ms"])
    )


def read_description(path: Path) -> dict[str, Any]:
    """A deployment description (a run directory stands for the ``deployment.json`` in it)."""
    path = Path(path)
    if path.is_dir():
        path = path / DESCRIPTION
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise DeploymentFileError(f"cannot read deployment description {path}: {reason}") from None
    if not isinstance(body, dict):
        raise DeploymentFileError(f"{path}: a deployment description is a JSON object")
    return body


def read_credentials(source: Path | Credentials | None) -> Credentials | None:
    """``{cluster: {username, password}}`` from a mapping or a YAML file; None stays None."""
    if source is None:
        return None
    origin = "credentials"
    if isinstance(source, str | Path):
        origin = str(source)
        try:  # guarded: random bytes, alias cycles or duplicate keys become a message naming the file
            source = load_yaml_file(Path(source)) or {}
        except YamlInputError as exc:
            raise DeploymentFileError(f"cannot read credentials {exc}") from None
    if not isinstance(source, dict):
        raise DeploymentFileError(f"{origin}: expected a mapping cluster -> {{username, password}}")
    result: Credentials = {}
    for cluster, entry in source.items():
        if not isinstance(entry, dict) or not {"username", "password"} <= set(entry):
            raise DeploymentFileError(f"{origin}: {cluster}: needs username and password")
        result[str(cluster)] = {"username": str(entry["username"]), "password": str(entry["password"])}
    return result


def onboard(endpoints: ClusterEndpoints, admin_password: str, username: str) -> tuple[ClusterSession, str]:
    """Create an account through the cluster's own admin and log it in; returns it and its password."""
    password = secrets.token_urlsafe(18)
    with AuthClient(endpoints.auth) as auth:
        admin = auth.login("admin", admin_password)
        auth.create_account(admin.token, username, password, role="user")
    return ClusterSession.login(endpoints, username, password), password


@dataclass
class DeploymentTarget:
    """A deployment's clusters (endpoints, admin password files) and the WAN it was started with."""

    clusters: dict[str, tuple[ClusterEndpoints, Path]]
    link: LinkProfile | None = None
    description: dict[str, Any] = field(default_factory=dict)
    origin: str = DESCRIPTION

    @classmethod
    def load(cls, path: Path) -> DeploymentTarget:
        description = read_description(path)
        clusters = endpoints_from_description(description)
        return cls(clusters, link_from_description(description), description, str(path))

    def admin_password(self, cluster: str) -> str:
        _, admin_file = self.clusters[cluster]
        try:
            return admin_file.read_text().strip()
        except OSError as exc:
            raise DeploymentFileError(
                f"cluster {cluster}: cannot read the admin password file {admin_file} ({exc.strerror}); "
                "pass credentials to act as your own account"
            ) from None

    def check_clusters(self, clusters: set[str]) -> None:
        """Refuse clusters the deployment does not have, naming them."""
        unknown = sorted(clusters - set(self.clusters))
        if unknown:
            raise DeploymentFileError(f"cluster(s) {', '.join(unknown)} are not in {self.origin}")

    def login(self, credentials: Credentials) -> dict[str, ClusterSession]:
        """A session per cluster named in ``credentials``, as that account."""
        self.check_clusters(set(credentials))
        return {
            cluster: ClusterSession.login(self.clusters[cluster][0], entry["username"], entry["password"])
            for cluster, entry in sorted(credentials.items())
        }

    def admin_sessions(self) -> dict[str, ClusterSession]:
        """Each cluster's admin (sees and may cancel every job there)."""
        return {
            cluster: ClusterSession.login(endpoints, "admin", self.admin_password(cluster))
            for cluster, (endpoints, _) in sorted(self.clusters.items())
        }

    @property
    def run_dir(self) -> Path:
        """The folder of the description: where credentials created for it are kept (0600)."""
        origin = Path(self.origin)
        return origin if origin.is_dir() else origin.parent

    def new_accounts(self, clusters: set[str]) -> tuple[dict[str, ClusterSession], Credentials]:
        """A fresh account in each of ``clusters``, created by its admin: sessions and their credentials.

        One name in every cluster (each with its own password), so the credentials are one file
        (``nebula_common.credentials``) that ``--credentials`` reads back, like an account made by
        ``nebula account create``.
        """
        self.check_clusters(clusters)
        sessions, credentials = {}, {}
        name = f"job-{secrets.token_hex(3)}"
        for cluster in sorted(clusters):
            session, password = onboard(self.clusters[cluster][0], self.admin_password(cluster), name)
            sessions[cluster] = session
            credentials[cluster] = {"username": name, "password": password}
        return sessions, credentials


__all__ = [
    "Credentials",
    "DeploymentFileError",
    "DeploymentTarget",
    "endpoints_from_description",
    "link_from_description",
    "onboard",
    "read_credentials",
    "read_description",
]
