"""Settings of the auth service, read from ``NEBULA_AUTH_*`` environment variables."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.auth.passwords import DEFAULT_MEMORY_COST_KIB, DEFAULT_PARALLELISM, DEFAULT_TIME_COST

ENV_PREFIX = "NEBULA_AUTH_"
_CLUSTER_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


class AuthSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    cluster_id: str
    """Cluster this service authenticates for; it becomes the token issuer ``nebula-auth/<id>``."""
    listen: str = "127.0.0.1:0"
    data_dir: Path
    """Holds accounts.db and signing-key.pem; must persist across restarts."""
    token_ttl_seconds: int = 3600
    admin_username: str = "admin"
    admin_password_file: Path | None = None
    """If set and the admin account is missing at start-up, it is created with this file's password."""
    metrics_port: int = 0
    """Prometheus port: 0 picks a free one, -1 disables the endpoint."""
    log_level: str = "INFO"
    argon2_time_cost: int = DEFAULT_TIME_COST
    argon2_memory_cost_kib: int = DEFAULT_MEMORY_COST_KIB
    argon2_parallelism: int = DEFAULT_PARALLELISM
    max_failed_logins: int = 5
    """Consecutive wrong passwords after which an account is locked."""
    lockout_seconds: int = 300
    """How long a locked account refuses logins (an admin's EnableAccount lifts it early)."""
    audit_seal_interval_s: float = 5.0
    """Seal the audit log (data_dir/audit.log) at least this often while events arrive."""

    @model_validator(mode="before")
    @classmethod
    def _name_missing_variables(cls, data: Any) -> Any:
        """Fail with the environment variable names an operator has to set, not field names."""
        if isinstance(data, dict):
            missing = [
                ENV_PREFIX + name.upper()
                for name, field in cls.model_fields.items()
                if field.is_required() and data.get(name) in (None, "")
            ]
            if missing:
                raise ValueError(f"missing required setting(s): {', '.join(missing)}")
        return data

    @field_validator("cluster_id")
    @classmethod
    def _check_cluster_id(cls, value: str) -> str:
        # It is embedded in the token issuer and log lines, so keep it a plain identifier.
        if not _CLUSTER_ID_PATTERN.fullmatch(value):
            raise ValueError(
                f"{ENV_PREFIX}CLUSTER_ID must be 1-63 characters of letters, digits, '.', '_' or '-'"
            )
        return value

    @field_validator("token_ttl_seconds")
    @classmethod
    def _check_ttl(cls, value: int) -> int:
        if value <= 0:
            raise ValueError(f"{ENV_PREFIX}TOKEN_TTL_SECONDS must be positive")
        return value

    @field_validator("max_failed_logins", "lockout_seconds")
    @classmethod
    def _check_lockout(cls, value: int) -> int:
        if value < 1:
            raise ValueError(
                f"{ENV_PREFIX}MAX_FAILED_LOGINS and {ENV_PREFIX}LOCKOUT_SECONDS must be at least 1"
            )
        return value

    @field_validator("audit_seal_interval_s")
    @classmethod
    def _check_seal_interval(cls, value: float) -> float:
        if value <= 0:
            raise ValueError(f"{ENV_PREFIX}AUDIT_SEAL_INTERVAL_S must be positive")
        return value

    @field_validator("metrics_port")
    @classmethod
    def _check_metrics_port(cls, value: int) -> int:
        if value < -1 or value > 65535:
            raise ValueError(f"{ENV_PREFIX}METRICS_PORT must be -1 (disabled), 0 (any) or a port number")
        return value
