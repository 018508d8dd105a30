"""Domain errors shared across services; servicers map them to gRPC status codes."""

from __future__ import annotations


class NebulaError(Exception):
    """Base class for errors whose message is safe and useful to show a user."""


class AuthenticationError(NebulaError):
    """The caller's credentials (token, certificate) are missing or invalid."""


class PermissionDeniedError(NebulaError):
    """The caller is authenticated but not allowed to do this."""


class InvalidRequestError(NebulaError):
    """The request is malformed; the message names the field."""
