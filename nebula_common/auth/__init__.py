"""Token verification shared by every service that acts for a cluster's accounts."""

from nebula_common.auth.verifier import KeySnapshot, Principal, Revocation, TokenVerifier

__all__ = ["KeySnapshot", "Principal", "Revocation", "TokenVerifier"]
