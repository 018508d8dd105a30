"""A running deployment as one object: where its clusters' services are, and whose account to use.

The CLI and the SDK start from one of two files. A deployment description (``deployment.json``,
written by ``nebula local up`` and ``nebula demo`` into the run directory: every process's ports
and pid, each cluster's admin password file, the emulated WAN's shape, the trainers' data dirs),
or an endpoints file (``endpoints.json``, format below), the one file that targets *any*
deployment: a local run directory writes one beside its description, ``nebula compose endpoints``
writes one for a compose deployment, and docs/operations.md shows one for a Kubernetes
port-forward or ingress::

    {"nebula_endpoints": 1,
     "clusters": {"a": {"auth": "HOST:PORT", "trainer": "HOST:PORT", "switch": "HOST:PORT",
                        "data": "HOST:PORT",   # optional: the data service (`nebula account grants`)
                        "ca_cert": "a-ca.crt",                    # every port is verified against it
                        "admin_password_file": "a-admin-password", # optional (else --credentials)
                        "metrics": {"switch-a": "https://HOST:PORT/metrics"},   # optional
                        "monitoring_tls": "a-monitoring"},  # the scraper identity /metrics ask for
                  "b": {...}},
     "link": {"bandwidth_mbit": 60, "rtt_ms": 40},                 # optional: for `codec: auto`
     "logs": {"command": ["podman-compose", "-f", "docker-compose.yml", "logs"],
              "services": ["trainer-a", "switch-a", ...]}}          # optional: `nebula job logs`

Relative paths are relative to the file. This module reads either and logs in: as given accounts
(``credentials``: ``{cluster: {username, password}}`` or a YAML file of that), as each cluster's
admin (who sees every job), or, to submit with nothing else at hand, as a fresh account per
cluster created through that cluster's admin (what an operator onboarding a researcher does).
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nebula_common.clients.endpoints import ClusterEndpoints
from nebula_common.durable import atomic_write
from nebula_common.launcher.run_dir import running_deployment_pid
from nebula_common.metrics import metrics_url, trust_metrics_endpoint
from nebula_common.pki.service_identity import ServiceTlsFiles
from nebula_common.rpc.internal_tls import ClientTls, trust_endpoint
from nebula_common.safe_yaml import YamlInputError, load_yaml_file
from nebula_common.sdk.auth_client import AuthClient
from nebula_common.sdk.client import ClusterSession
from nebula_common.sdk.endpoints_file import (
    ENDPOINTS_FORMAT,
    DeploymentFileError,
    endpoints_from_file,
    logs_from,
)
from nebula_common.sdk.links import LinkProfile

LOOPBACK = "127.0.0.1"
DESCRIPTION = "deployment.json"
ENDPOINTS = "endpoints.json"

Credentials = dict[str, dict[str, str]]


def trust_described_cluster(cluster: str, entry: dict[str, Any]) -> None:
    """Verify every internal port of ``cluster`` against its CA (the description's ``ca_cert``).

    A description without one (written before internal TLS) leaves the ports unregistered: the
    clients then need ``NEBULA_CA_CERT``, or the development flag for a plaintext deployment.
    """
    ca = entry.get("ca_cert")
    if not ca:
        return
    tls = ClientTls(cluster, Path(ca))
    scraper = entry.get("monitoring_tls")
    for name, info in entry["processes"].items():
        for key in ("grpc_port", "internal_port", "service_port"):
            port = info.get(key)
            if isinstance(port, int) and port > 0:
                trust_endpoint(f"{LOOPBACK}:{port}", tls)
        port = info.get("metrics_port")
        if isinstance(scraper, str) and info.get("metrics_scheme") == "https" and isinstance(port, int):
            files = ServiceTlsFiles.in_dir(Path(scraper))
            trust_metrics_endpoint(f"{LOOPBACK}:{port}", files, cluster, name.removesuffix(f"-{cluster}"))


def endpoints_from_description(description: dict[str, Any]) -> dict[str, tuple[ClusterEndpoints, Path]]:
    """Cluster id -> (endpoints, admin password file) from a `nebula local up` deployment.json."""
    result = {}
    try:
        for cluster, entry in description["clusters"].items():
            processes = entry["processes"]
            trust_described_cluster(cluster, entry)
            urls = {name: metrics_url(LOOPBACK, info) for name, info in processes.items()}
            metrics = {name: url for name, url in urls.items() if url}
            endpoints = ClusterEndpoints(
                cluster_id=cluster,
                auth=f"{LOOPBACK}:{processes[f'auth-{cluster}']['grpc_port']}",
                trainer=f"{LOOPBACK}:{processes[f'trainer-{cluster}']['grpc_port']}",
                switch=f"{LOOPBACK}:{processes[f'switch-{cluster}']['internal_port']}",
                metrics=metrics,
                codec=f"{LOOPBACK}:{processes[f'codec-{cluster}']['grpc_port']}",
                data=_described_port(processes, f"data-{cluster}"),
            )
            result[cluster] = (endpoints, Path(entry["admin_password_file"]))
    except (KeyError, TypeError, AttributeError) as exc:
        raise DeploymentFileError(f"deployment description is missing {exc}") from exc
    return result


def _described_port(processes: dict[str, Any], name: str) -> str:
    """``name``'s client address, or "" for a description without it (only some commands need it)."""
    port = (processes.get(name) or {}).get("grpc_port")
    return f"{LOOPBACK}:{port}" if isinstance(port, int) and port > 0 else ""


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
        path = (
            path / DESCRIPTION
            if (path / DESCRIPTION).exists() or not (path / ENDPOINTS).exists()
            else path / ENDPOINTS
        )
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


def endpoints_body(target: DeploymentTarget, base: Path) -> dict[str, Any]:
    """The endpoints file of ``target`` (any deployment), paths written relative to ``base``."""

    def rel(path: Path) -> str:
        return os.path.relpath(Path(path).resolve(), Path(base).resolve())

    clusters: dict[str, Any] = {}
    for cluster, (endpoints, admin) in sorted(target.clusters.items()):
        ca = target.ca_certs.get(cluster)
        entry: dict[str, Any] = {
            "auth": endpoints.auth,
            "trainer": endpoints.trainer,
            "switch": endpoints.switch,
        }
        if endpoints.codec:
            entry["codec"] = endpoints.codec
        if endpoints.data:
            entry["data"] = endpoints.data
        if ca is not None:
            entry["ca_cert"] = rel(ca)
        if admin is not None:
            entry["admin_password_file"] = rel(admin)
        if endpoints.metrics:
            entry["metrics"] = dict(endpoints.metrics)
        scraper = target.monitoring.get(cluster)
        if scraper is not None:
            entry["monitoring_tls"] = rel(scraper)
        clusters[cluster] = entry
    body: dict[str, Any] = {"nebula_endpoints": ENDPOINTS_FORMAT, "clusters": clusters}
    if target.link is not None:
        body["link"] = {"bandwidth_mbit": target.link.bandwidth_mbit, "rtt_ms": target.link.rtt_ms}
    if target.logs:
        body["logs"] = target.logs
    run_dir = target.description.get("run_dir")
    if isinstance(run_dir, str):  # a local run: where its trainers' records are once it stopped
        body["run_dir"] = rel(Path(run_dir))
    return body


def write_endpoints_file(target: DeploymentTarget, path: Path) -> Path:
    """Write ``target``'s endpoints file (0644: it holds addresses and paths, no secret)."""
    path = Path(path)
    atomic_write(
        path, (json.dumps(endpoints_body(target, path.parent), indent=2) + "\n").encode(), mode=0o644
    )
    return path


@dataclass
class DeploymentTarget:
    """A deployment's clusters (endpoints, admin password files) and the WAN it was started with."""

    clusters: dict[str, tuple[ClusterEndpoints, Path | None]]
    link: LinkProfile | None = None
    description: dict[str, Any] = field(default_factory=dict)
    origin: str = DESCRIPTION
    ca_certs: dict[str, Path] = field(default_factory=dict)
    logs: dict[str, Any] = field(default_factory=dict)  # how to read the services' logs (endpoints file)
    monitoring: dict[str, Path] = field(default_factory=dict)  # each cluster's scraper identity (a dir)

    @classmethod
    def load(cls, path: Path) -> DeploymentTarget:
        """From a deployment description, an endpoints file, or a run directory holding either."""
        description = read_description(path)
        if "nebula_endpoints" in description:
            origin = Path(path) / ENDPOINTS if Path(path).is_dir() else Path(path)
            clusters = endpoints_from_file(description, origin.parent, str(origin))
            link = None
            if isinstance(description.get("link"), dict):
                try:
                    link = LinkProfile(
                        bandwidth_mbit=float(description["link"]["bandwidth_mbit"]),
                        rtt_ms=float(description["link"]["rtt_ms"]),
                    )
                except (KeyError, TypeError, ValueError):
                    raise DeploymentFileError(
                        f"{origin}: 'link' needs numbers bandwidth_mbit and rtt_ms"
                    ) from None
            cas = {c: origin.parent / description["clusters"][c]["ca_cert"] for c in clusters}
            if isinstance(description.get("run_dir"), str):  # a local run's: its records, once stopped
                description = {**description, "run_dir": str(origin.parent / description["run_dir"])}
            scrapers = {
                c: origin.parent / description["clusters"][c]["monitoring_tls"]
                for c in clusters
                if isinstance(description["clusters"][c].get("monitoring_tls"), str)
            }
            logs = logs_from(description, str(origin))
            return cls(clusters, link, description, str(path), cas, logs, scrapers)
        clusters = endpoints_from_description(description)
        cas = {
            c: Path(e["ca_cert"])
            for c, e in description["clusters"].items()
            if isinstance(e.get("ca_cert"), str)
        }
        scrapers = {
            c: Path(e["monitoring_tls"])
            for c, e in description["clusters"].items()
            if isinstance(e.get("monitoring_tls"), str)
        }
        return cls(clusters, link_from_description(description), description, str(path), cas, {}, scrapers)

    def admin_password(self, cluster: str) -> str:
        _, admin_file = self.clusters[cluster]
        if admin_file is None:
            raise DeploymentFileError(
                f"cluster {cluster}: {self.origin} names no admin password file; "
                "pass credentials to act as your own account"
            )
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

    def stopped_records(self) -> dict[str, Path] | None:
        """Cluster -> trainer data dir, when this is a `nebula local up` (or demo) deployment that has
        stopped (no process holds its run directory's lock); None while it runs, or for a deployment
        this machine does not hold the files of (compose, Kubernetes: ask its trainers)."""
        run_dir = self.description.get("run_dir")
        if not isinstance(run_dir, str) or not Path(run_dir).is_dir():
            return None
        if running_deployment_pid(Path(run_dir)) is not None:
            return None
        records = {}
        for cluster, entry in self.description.get("clusters", {}).items():
            data_dir = entry.get("trainer_data_dir") if isinstance(entry, dict) else None
            records[cluster] = (
                Path(data_dir) if isinstance(data_dir, str) else Path(run_dir) / cluster / "trainer"
            )
        return records

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
    "ENDPOINTS",
    "Credentials",
    "DeploymentFileError",
    "DeploymentTarget",
    "endpoints_body",
    "endpoints_from_description",
    "endpoints_from_file",
    "link_from_description",
    "onboard",
    "read_credentials",
    "read_description",
    "write_endpoints_file",
]
