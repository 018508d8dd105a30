"""Token verification shared by every service that acts for a cluster's accounts."""

from nebula_common.auth.verifier import Principal, TokenVerifier

__all__ = ["Principal", "TokenVerifier"]
