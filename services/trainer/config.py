"""Trainer settings from NEBULA_TRAINER_* environment variables."""

from __future__ import annotations

import tempfile
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class TrainerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="NEBULA_TRAINER_", extra="forbid")

    cluster_id: str = Field(pattern=r"^[a-z][a-z0-9-]{0,30}$", description="This cluster's id.")
    listen: str = Field("127.0.0.1:0", description="Cluster-internal control port (SDK -> trainer).")
    switch_address: str = Field(description="host:port of this cluster's switch internal port.")
    auth_address: str = Field(description="host:port of this cluster's auth service.")
    metrics_port: int = Field(0, ge=-1, le=65535, description="Prometheus port; 0 picks one, -1 disables.")
    torch_threads: int = Field(1, ge=1, le=256, description="Intra-op threads for torch on this trainer.")
    data_dir: Path | None = Field(
        None, description="Where stage checkpoints go (default: <tmp>/nebula-trainer-<cluster_id>)."
    )
    data_service_address: str | None = Field(
        None, description="host:port of this cluster's data service (stages that train on granted datasets)."
    )
    log_level: str = "INFO"

    def resolved_data_dir(self) -> Path:
        return self.data_dir or Path(tempfile.gettempdir()) / f"nebula-trainer-{self.cluster_id}"
