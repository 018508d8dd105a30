"""Codec service settings, read from ``NEBULA_CODEC_*`` environment variables.

Defaults suit a local run and tests (loopback, ephemeral ports); deployments set
``NEBULA_CODEC_LISTEN`` and ``NEBULA_CODEC_METRICS_PORT`` explicitly.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from nebula_common.service.settings import HostPort, ServiceSettings


class CodecSettings(ServiceSettings):
    """Where the codec service listens, whom it trusts for tokens, and how it calibrates."""

    model_config = SettingsConfigDict(env_prefix="NEBULA_CODEC_")

    listen: HostPort = Field(default="127.0.0.1:0", description="gRPC listen address host:port.")
    auth_address: HostPort = Field(description="host:port of this cluster's auth service (token keys).")
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

    def calibration_path(self) -> Path | None:
        """Where the calibration is cached, or None when caching is off."""
        value = self.calibration_cache.strip()
        if value.lower() == "off":
            return None
        if not value:
            from nebula_common.codec.calibration import default_cache_path

            return default_cache_path()
        return Path(value)
