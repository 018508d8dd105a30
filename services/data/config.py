"""Settings of the data service, read from ``NEBULA_DATA_*`` environment variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from nebula_common.service.settings import AuditedServiceSettings, HostPort


class DataSettings(AuditedServiceSettings):
    """Each account's datasets, served to its own trainers and to grantees."""

    model_config = SettingsConfigDict(env_prefix="NEBULA_DATA_")

    listen: HostPort = Field("127.0.0.1:0", description="Cluster-internal port (SDK, trainers).")
    auth_address: HostPort = Field(description="host:port of this cluster's auth service (token keys).")
    data_dir: Path = Field(
        description="Holds accounts/<owner>/datasets, accounts/<owner>/inbox and the audit log; must persist."
    )
    max_dataset_bytes: int = Field(
        4 * 1024**3, ge=1, description="Largest dataset (JSON Lines bytes) an upload or import may create."
    )
    max_batch_examples: int = Field(
        4096, ge=1, le=1_000_000, description="Most example ids one ReadBatch may ask for."
    )
