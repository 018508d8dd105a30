"""Channel options shared by every internal client, and the plaintext channel of tests."""

from __future__ import annotations

from typing import Any

import grpc

from nebula_common.rpc.server import GRPC_MESSAGE_LIMIT


def internal_channel_options() -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", GRPC_MESSAGE_LIMIT),
        ("grpc.max_send_message_length", GRPC_MESSAGE_LIMIT),
    ]


def insecure_channel(address: str, *, aio: bool = False) -> grpc.Channel | grpc.aio.Channel:
    """Plaintext channel, for servers that serve no TLS (in-process test servers, raw sinks).

    Nebula's internal ports serve TLS: reach them with ``internal_tls.internal_channel``, which
    verifies the cluster CA and falls back to plaintext only under the development flag.
    """
    if aio:
        return grpc.aio.insecure_channel(address, options=internal_channel_options())
    return grpc.insecure_channel(address, options=internal_channel_options())
