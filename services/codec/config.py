"""Codec service settings, read from ``NEBULA_CODEC_*`` environment variables.

Defaults suit a local run and tests (loopback, ephemeral ports); deployments set
``NEBULA_CODEC_LISTEN`` and ``NEBULA_CODEC_METRICS_PORT`` explicitly.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from nebula_common.metrics import METRICS_DISABLED


class CodecSettings(BaseSettings):
    """Where the codec service listens and how it reports."""

    model_config = SettingsConfigDict(env_prefix="NEBULA_CODEC_", extra="ignore")

    listen: str = Field(default="127.0.0.1:0", min_length=1, description="gRPC listen address host:port.")
    metrics_port: int = Field(
        default=0,
        ge=METRICS_DISABLED,
        le=65535,
        description="Prometheus port: 0 picks a free port, -1 disables the endpoint.",
    )
    cluster_id: str = Field(default="local", min_length=1, description="Cluster this instance serves.")
    log_level: str = Field(default="INFO", description="Python logging level name.")
    calibration_cache: str = Field(
        default="",
        description=(
            "JSON file caching this host's codec calibration for Advise: empty means "
            "$XDG_CACHE_HOME/nebula/codec-calibration.json, 'off' disables the cache."
        ),
    )
    calibrate_at_start: bool = Field(
        default=True,
        description="Calibrate codec costs at start-up (in the background); otherwise on the first Advise.",
    )
    torch_threads: int = Field(
        default=1,
        ge=1,
        le=256,
        description="Intra-op threads for codec work; 1 keeps requests from oversubscribing cores.",
    )
    max_tensor_bytes: int = Field(
        default=1 << 30, ge=1, description="Largest raw tensor one streaming call may carry, in bytes."
    )

    @field_validator("listen")
    @classmethod
    def _listen_has_port(cls, value: str) -> str:
        host, sep, port = value.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"listen must be host:port, got {value!r}")
        return value.strip()

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        level = value.strip().upper()
        if level not in logging.getLevelNamesMapping():
            raise ValueError(f"unknown log level {value!r}")
        return level

    def calibration_path(self) -> Path | None:
        """Where the calibration is cached, or None when caching is off."""
        value = self.calibration_cache.strip()
        if value.lower() == "off":
            return None
        if not value:
            from nebula_common.codec.calibration import default_cache_path

            return default_cache_path()
        return Path(value)
