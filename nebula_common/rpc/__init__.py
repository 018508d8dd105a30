"""gRPC plumbing shared by every Nebula service: server factory, channels, bearer tokens."""

from nebula_common.rpc.channels import insecure_channel, internal_channel_options
from nebula_common.rpc.metadata import BEARER_PREFIX, bearer_metadata, bearer_token_from_metadata
from nebula_common.rpc.server import GRPC_MESSAGE_LIMIT, ServiceServer, create_server

__all__ = [
    "BEARER_PREFIX",
    "GRPC_MESSAGE_LIMIT",
    "ServiceServer",
    "bearer_metadata",
    "bearer_token_from_metadata",
    "create_server",
    "insecure_channel",
    "internal_channel_options",
]
