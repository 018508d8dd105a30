"""Settings of the auth service, read from ``NEBULA_AUTH_*`` environment variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from nebula_common.service.settings import AuditedServiceSettings, HostPort
from services.auth.passwords import DEFAULT_MEMORY_COST_KIB, DEFAULT_PARALLELISM, DEFAULT_TIME_COST

ENV_PREFIX = "NEBULA_AUTH_"


class AuthSettings(AuditedServiceSettings):
    """Accounts, tokens and the bootstrap admin of one cluster (issuer ``nebula-auth/<id>``)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX)

    listen: HostPort = Field("127.0.0.1:0", description="Cluster-internal gRPC address host:port.")
    data_dir: Path = Field(description="Holds accounts.db and signing-key.pem; must persist across restarts.")
    token_ttl_seconds: int = Field(3600, gt=0, description="Lifetime of issued tokens.")
    job_token_ttl_seconds: int = Field(
        900,
        gt=0,
        description=(
            "Lifetime of a job token (IssueJobToken; never longer than token_ttl_seconds): the trainer "
            "renews it at half-life while the job runs."
        ),
    )
    admin_username: str = Field("admin", min_length=1, description="Name of the bootstrap admin.")
    admin_password_file: Path | None = Field(
        None,
        description="If set and the admin account is missing at start-up, it is created with this password.",
    )
    argon2_time_cost: int = Field(
        DEFAULT_TIME_COST, ge=1, description="Argon2id passes per password hash (OWASP's minimum: 2)."
    )
    argon2_memory_cost_kib: int = Field(
        DEFAULT_MEMORY_COST_KIB, ge=8, description="Argon2id memory per password hash, KiB (OWASP: 19 MiB)."
    )
    argon2_parallelism: int = Field(
        DEFAULT_PARALLELISM, ge=1, description="Argon2id lanes per password hash."
    )
    max_failed_logins: int = Field(5, ge=1, description="Consecutive wrong passwords before a lockout.")
    lockout_seconds: int = Field(
        300, ge=1, description="How long a locked account refuses logins (EnableAccount lifts it early)."
    )
