"""Who a verified token speaks for, and the claims every cluster's services agree on (``verifier.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

AUDIENCE = "nebula"
LEEWAY_SECONDS = 30
"""Clock skew tolerated on exp/nbf/iat: the clusters' clocks are not perfectly in sync."""

JOB_ROLE = "job"
"""The role claim of a job token: never an account's role, so no role check can mistake it for one."""


@dataclass(frozen=True)
class Principal:
    """Who authorised a call: an account of ``cluster_id`` with ``role``.

    ``job_id`` is set for a job token (role ``job``, ``auth.proto`` IssueJobToken): it acts for
    ``username`` in that one job only (``policy.JOB_METHODS``).
    """

    username: str
    role: str
    cluster_id: str
    job_id: str = ""
    issued_at: float = field(default=0.0, compare=False)
    """The token's ``iat`` (Unix seconds): a live edge opened with it ends once the account's tokens
    issued before some time are revoked (``revocation_reason``). Not part of who the principal is."""
    expires_at: float = field(default=0.0, compare=False)
    """The token's ``exp`` (Unix seconds): a live edge opened with it ends once every service refuses
    it (``exp`` plus :data:`LEEWAY_SECONDS`) unless its trainer renewed it (``Relay/RenewEdges``)."""
