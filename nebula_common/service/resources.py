"""Resources most services acquire at start-up, each registered for ordered cleanup."""

from __future__ import annotations

import asyncio
import contextlib

from nebula_common.auth import TokenVerifier

AUTH_WAIT_S = 30.0
"""How long a service waits for its cluster's auth service at start-up (they often start together)."""


async def token_verifier(
    stack: contextlib.AsyncExitStack, auth_address: str, cluster_id: str, timeout: float = AUTH_WAIT_S
) -> TokenVerifier:
    """Fetch this cluster's token keys from auth; the verifier's background refresh stops with the stack."""
    verifier = await TokenVerifier.from_auth_service_async(auth_address, cluster_id, timeout=timeout)
    stack.push_async_callback(asyncio.to_thread, verifier.close)
    return verifier
