"""Settings of the audit signer, read from ``NEBULA_SIGNER_*`` environment variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from nebula_common.service.settings import ServiceSettings


class SignerSettings(ServiceSettings):
    """Which logs this signer seals, where their keys live, where each service asks."""

    model_config = SettingsConfigDict(env_prefix="NEBULA_SIGNER_")

    data_dir: Path = Field(
        description="Holds <log>/audit-key.pem and <log>/seal-state.json for each log; only the signer "
        "may read it, and it must persist (a lost position trusts the next chain on first use)."
    )
    sockets: str = Field(
        description="The logs it seals and where their services ask, comma-separated <log>=<socket path> "
        "(e.g. 'auth=/run/a/auth/signer/signer.sock'); each socket's directory is made 0700, and only its "
        "service should reach it: whoever reaches a socket can append to that log's sealed chain."
    )

    @field_validator("sockets")
    @classmethod
    def _parse_sockets(cls, value: str) -> str:
        seen = set()
        for entry in value.split(","):
            name, _, path = entry.strip().partition("=")
            if not name or not name.isidentifier() or not path.startswith("/"):
                raise ValueError(f"{entry.strip()!r}: expected <log>=<absolute socket path>")
            if name in seen:
                raise ValueError(f"log {name!r} is named twice")
            seen.add(name)
        return value

    def socket_map(self) -> dict[str, Path]:
        """Each log's name and socket path."""
        pairs = (entry.strip().partition("=") for entry in self.sockets.split(","))
        return {name: Path(path) for name, _, path in pairs}
