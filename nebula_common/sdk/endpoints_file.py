"""Reading an endpoints file (``endpoints.json``): the one file that targets any deployment.

Its format is in :mod:`nebula_common.sdk.deployment`'s docstring. Every address it names is
registered to be verified against its cluster's CA, and every field is checked where it is read,
so a bad file is refused naming the file and the key.
"""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import Any

from nebula_common.clients.endpoints import ClusterEndpoints
from nebula_common.errors import NebulaError
from nebula_common.metrics import trust_metrics_endpoint
from nebula_common.pki.service_identity import ServiceTlsFiles
from nebula_common.rpc.internal_tls import ClientTls, trust_endpoint

__all__ = ["ENDPOINTS_FORMAT", "DeploymentFileError", "endpoints_from_file", "logs_from"]

ENDPOINTS_FORMAT = 1


class DeploymentFileError(NebulaError):
    """A deployment description or credentials file that cannot be used (the message names it)."""


def _address(cluster: str, entry: dict[str, Any], key: str, origin: str) -> str:
    value = entry.get(key)
    host, _, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DeploymentFileError(f"{origin}: clusters.{cluster}.{key}: expected HOST:PORT, got {value!r}")
    return value


def endpoints_from_file(
    body: dict[str, Any], base: Path, origin: str
) -> dict[str, tuple[ClusterEndpoints, Path | None]]:
    """Cluster id -> (endpoints, admin password file or None) from an endpoints file (module doc).

    Every address of a cluster is registered to be verified against that cluster's CA, so a
    compose deployment's or a port-forward's ports are checked exactly as a local one's.
    """
    if body.get("nebula_endpoints") != ENDPOINTS_FORMAT:
        raise DeploymentFileError(f"{origin}: 'nebula_endpoints' must be {ENDPOINTS_FORMAT}")
    clusters = body.get("clusters")
    if not isinstance(clusters, dict) or not clusters:
        raise DeploymentFileError(f"{origin}: 'clusters' must map each cluster id to its endpoints")
    result: dict[str, tuple[ClusterEndpoints, Path | None]] = {}
    for cluster, entry in clusters.items():
        if not isinstance(entry, dict):
            raise DeploymentFileError(f"{origin}: clusters.{cluster} must be an object")
        auth, trainer, switch = (_address(cluster, entry, k, origin) for k in ("auth", "trainer", "switch"))
        ca = entry.get("ca_cert")
        if not isinstance(ca, str) or not ca:
            raise DeploymentFileError(
                f"{origin}: clusters.{cluster}.ca_cert: the cluster's CA certificate is required"
            )
        ca_path = base / ca
        if not ca_path.is_file():
            raise DeploymentFileError(f"{origin}: clusters.{cluster}.ca_cert: no file {ca_path}")
        codec, data = (_address(cluster, entry, k, origin) if entry.get(k) else "" for k in ("codec", "data"))
        metrics = entry.get("metrics") or {}
        if not isinstance(metrics, dict) or not all(isinstance(v, str) for v in metrics.values()):
            raise DeploymentFileError(f"{origin}: clusters.{cluster}.metrics must map names to URLs")
        tls = ClientTls(str(cluster), ca_path)
        for address in (auth, trainer, switch, codec, data):
            if address:
                trust_endpoint(address, tls)
        _trust_metrics_of_file(str(cluster), entry, metrics, base, origin)
        admin = entry.get("admin_password_file")
        if admin is not None and not isinstance(admin, str):
            raise DeploymentFileError(f"{origin}: clusters.{cluster}.admin_password_file must be a path")
        endpoints = ClusterEndpoints(str(cluster), auth, trainer, switch, dict(metrics), codec, data)
        result[str(cluster)] = (endpoints, base / admin if admin else None)
    return result


def _trust_metrics_of_file(
    cluster: str, entry: dict[str, Any], metrics: dict[str, str], base: Path, origin: str
) -> None:
    """Read the ``https`` metrics URLs of an endpoints file with its ``monitoring_tls`` identity."""
    scraper = entry.get("monitoring_tls")
    if scraper is None:
        return
    if not isinstance(scraper, str) or not (base / scraper).is_dir():
        raise DeploymentFileError(
            f"{origin}: clusters.{cluster}.monitoring_tls: no directory {base / str(scraper)} "
            "(the scraper identity: ca.crt, service.crt, service.key)"
        )
    files = ServiceTlsFiles.in_dir(base / scraper)
    for name, url in metrics.items():
        parts = urllib.parse.urlsplit(url)
        if parts.scheme == "https" and parts.netloc:
            trust_metrics_endpoint(parts.netloc, files, cluster, name.removesuffix(f"-{cluster}"))


def logs_from(body: dict[str, Any], origin: str) -> dict[str, Any]:
    logs = body.get("logs")
    if logs is None:
        return {}
    command, services = (
        (logs.get("command"), logs.get("services")) if isinstance(logs, dict) else (None, None)
    )
    if not (isinstance(command, list) and command and all(isinstance(c, str) for c in command)) or not (
        isinstance(services, list) and all(isinstance(c, str) for c in services)
    ):
        raise DeploymentFileError(f"{origin}: 'logs' needs 'command' (a list of strings) and 'services'")
    return {"command": command, "services": services}
