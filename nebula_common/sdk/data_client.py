"""The data service's typed client, as part of the public SDK.

The implementation lives in :mod:`nebula_common.clients.data`, below the services, because the
trainer (a service) reads granted datasets with it and must not import the user-facing SDK; this
module keeps the SDK's import path.
"""

from nebula_common.clients.data import (
    DEFAULT_TIMEOUT_SECONDS,
    UPLOAD_CHUNK_BYTES,
    DataClient,
    DataServiceUnavailableError,
    DatasetExistsError,
    DatasetInfo,
    DatasetNotFoundError,
    GrantInfo,
    parse_dataset_ref,
)

__all__ = [
    "DEFAULT_TIMEOUT_SECONDS",
    "UPLOAD_CHUNK_BYTES",
    "DataClient",
    "DataServiceUnavailableError",
    "DatasetExistsError",
    "DatasetInfo",
    "DatasetNotFoundError",
    "GrantInfo",
    "parse_dataset_ref",
]
