"""The settings base every Nebula service extends: one cluster-id rule, one ``extra`` policy.

Each service reads ``NEBULA_<SERVICE>_*`` environment variables into a subclass
of ``ServiceSettings``. Unknown keyword settings are refused (``extra="forbid"``)
so a typo in a test or an embedding program fails loudly instead of being
ignored; the shared fields below validate the same way in every service, and a
bad value is reported by ``describe_validation_error`` with the environment
variable an operator has to fix.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from nebula_common.metrics import METRICS_DISABLED
from nebula_common.pki.identity import CLUSTER_ID_PATTERN


def _host_port(value: str) -> str:
    host, sep, port = value.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"must be host:port, got {value!r}")
    return value.strip()


def _log_level(value: str) -> str:
    level = value.strip().upper()
    if level not in logging.getLevelNamesMapping():
        raise ValueError(f"unknown log level {value!r}")
    return level


HostPort = Annotated[str, AfterValidator(_host_port)]
"""``host:port`` (IPv6 hosts in brackets); port 0 asks the kernel for a free one."""

ClusterId = Annotated[
    str,
    Field(
        pattern=CLUSTER_ID_PATTERN,
        description="This cluster's id: a lowercase DNS label of at most 31 characters, e.g. 'a'.",
    ),
]


class ServiceSettings(BaseSettings):
    """Fields and rules every service shares; subclasses set ``env_prefix`` and add their own."""

    model_config = SettingsConfigDict(extra="forbid")

    cluster_id: ClusterId
    log_level: Annotated[str, AfterValidator(_log_level)] = Field(
        "INFO", description="Python logging level name."
    )
    metrics_port: int = Field(
        0, ge=METRICS_DISABLED, le=65535, description="Prometheus port: 0 picks a free one, -1 disables it."
    )
    internal_tls_dir: Path | None = Field(
        None,
        description=(
            "Directory holding this service's internal identity: ca.crt (the cluster CA), service.crt, "
            "service.key (nebula_common/pki/service_identity.py). Required unless the development flag "
            "NEBULA_INTERNAL_PLAINTEXT=1 is set."
        ),
    )
    service_listen: HostPort = Field(
        "127.0.0.1:0",
        description="The mutual-TLS port the cluster's other services call (client certificate required).",
    )
    health_listen: HostPort | None = Field(
        None,
        description=(
            "Optional plaintext listener serving grpc.health.v1 only, for probes that cannot speak TLS "
            "(Kubernetes' native gRPC probes)."
        ),
    )
    internal_crl: Path | None = Field(
        None,
        description=(
            "The cluster CA's CRL (PEM, `nebula pki revoke`): client certificates it lists are refused on "
            "the internal ports; re-read every check interval, accepted only if ca.crt signed it."
        ),
    )


def unknown_variables(settings: type[BaseSettings], environ: Mapping[str, str]) -> list[str]:
    """``environ``'s variables under the service's prefix that name no setting, sorted.

    pydantic-settings ignores them; a service refuses to start with one instead, so a typo or a
    variable that is no longer a setting (a constant now) is not silently without effect.
    """
    prefix = str(settings.model_config.get("env_prefix", "")).upper()
    if not prefix:
        return []
    known = {prefix + name.upper() for name in settings.model_fields}
    return sorted(k for k in environ if k.upper().startswith(prefix) and k.upper() not in known)


def describe_validation_error(settings: type[BaseSettings], exc: ValidationError) -> str:
    """One line per problem, each naming the environment variable to fix (``NEBULA_CODEC_LISTEN: ...``)."""
    prefix = str(settings.model_config.get("env_prefix", ""))
    lines = []
    for error in exc.errors():
        location = ".".join(str(part) for part in error.get("loc", ()) if part != "__root__")
        name = (prefix + location).upper() if location else prefix.rstrip("_") or settings.__name__
        message: Any = error.get("msg", "invalid")
        if error.get("type") == "missing":
            message = "required but not set"
        lines.append(f"{name}: {message}")
    return "; ".join(lines)


class AuditedServiceSettings(ServiceSettings):
    """A service that writes an audit log (auth, data, switch, trainer): who seals it."""

    audit_signer: str = Field(
        "",
        description="unix:<path> of the audit signer that seals this service's audit log (services/signer): "
        "the service then holds no audit key. Empty: it keeps its own key (audit-key.pem in its data "
        "directory), which whoever breaks into it could use to re-sign a rewritten past.",
    )
