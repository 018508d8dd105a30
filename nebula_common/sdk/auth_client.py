"""The auth service's typed client, as part of the public SDK.

The implementation lives in :mod:`nebula_common.clients.auth`, below the services, because
library code must not import the user-facing SDK; this module keeps the SDK's import path.
"""

from nebula_common.clients.auth import (
    DEFAULT_TIMEOUT_SECONDS,
    AccountExistsError,
    AccountInfo,
    AuthClient,
    LoginResult,
    ServiceUnavailableError,
    TokenStatus,
)

__all__ = [
    "DEFAULT_TIMEOUT_SECONDS",
    "AccountExistsError",
    "AccountInfo",
    "AuthClient",
    "LoginResult",
    "ServiceUnavailableError",
    "TokenStatus",
]
