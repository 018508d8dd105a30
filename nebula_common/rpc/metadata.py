"""Bearer-token call metadata, the one way callers prove who authorised a call."""

from __future__ import annotations

from collections.abc import Iterable

BEARER_PREFIX = "Bearer "


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", BEARER_PREFIX + token),)


def bearer_token_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """Return the bearer token of a call, or None when it carries none."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            if text.startswith(BEARER_PREFIX):
                token = text[len(BEARER_PREFIX) :].strip()
                return token or None
    return None
