"""Typed low-level gRPC clients of Nebula's services, and plain descriptions of where they listen.

Why here and not in ``nebula_common.sdk``: services and shared library code need these clients
too (a trainer stage reads a granted dataset through :class:`DataClient`), and the layering
(shared library -> services -> user-facing SDK/CLI/launcher) lets nothing below the SDK import the
SDK. So the clients live at the bottom, next to the protobuf stubs they wrap, and the SDK
re-exports them: ``nebula_common.sdk.auth_client`` and ``nebula_common.sdk.data_client`` keep
working for scripts. Nothing in this package may import ``services`` or the user-facing packages.
"""

from nebula_common.clients.auth import AccountExistsError, AuthClient, ServiceUnavailableError
from nebula_common.clients.data import (
    DataClient,
    DataServiceUnavailableError,
    DatasetExistsError,
    DatasetInfo,
    DatasetNotFoundError,
    GrantInfo,
    parse_dataset_ref,
)
from nebula_common.clients.endpoints import ClusterEndpoints

__all__ = [
    "AccountExistsError",
    "AuthClient",
    "ClusterEndpoints",
    "DataClient",
    "DataServiceUnavailableError",
    "DatasetExistsError",
    "DatasetInfo",
    "DatasetNotFoundError",
    "GrantInfo",
    "ServiceUnavailableError",
    "parse_dataset_ref",
]
