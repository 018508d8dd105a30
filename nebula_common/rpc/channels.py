"""Client channels for cluster-internal calls (trainer -> switch, SDK -> services)."""

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
    """Plaintext channel to a service on the cluster-internal network.

    Only the switch's WAN port faces the other cluster, and it is always mTLS;
    internal services are reached over the cluster's private network.
    """
    if aio:
        return grpc.aio.insecure_channel(address, options=internal_channel_options())
    return grpc.insecure_channel(address, options=internal_channel_options())
