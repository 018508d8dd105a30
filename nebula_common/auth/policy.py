"""Who may call which RPC: the one access table of every Nebula service's internal port.

Default deny: every method of every Nebula service needs a bearer token of this
cluster, except the few below whose request *is* the credential, and the gRPC
health and reflection services that orchestrators and operators probe. A method
added to a proto is therefore protected before anyone remembers to protect it;
``tests/integration/test_rpc_refusals.py`` walks the service descriptors and
proves it for every method.

The switch's WAN port is not in this table: the peer switch holds no token of this
cluster, so that port is authenticated by mutual TLS and the certificate's SPIFFE
identity instead (``services/switch/link_handshake.py``).
"""

from __future__ import annotations

from types import MappingProxyType

PUBLIC_METHODS = MappingProxyType(
    {
        "/nebula.v1.Auth/Login": "the username and password in the request are the credential",
        "/nebula.v1.Auth/GetSigningKeys": (
            "public keys and revocations: every verifier needs them before it can check any token"
        ),
        "/nebula.v1.Auth/VerifyToken": (
            "the token to check is the request itself; the answer is only valid/invalid"
        ),
    }
)
"""Full method name -> why it needs no bearer token."""

ADMIN_METHODS = frozenset(
    {
        "/nebula.v1.Auth/CreateAccount",
        "/nebula.v1.Auth/ListAccounts",
        "/nebula.v1.Auth/DisableAccount",
        "/nebula.v1.Auth/EnableAccount",
        "/nebula.v1.Auth/DeleteAccount",
        "/nebula.v1.Auth/RotateSigningKey",
        "/nebula.v1.AuditLog/Query",
        "/nebula.v1.AuditLog/GetAuditKey",
    }
)
"""Methods that need an admin of this cluster (PERMISSION_DENIED for any other account)."""

JOB_METHODS = frozenset(
    {
        "/nebula.v1.Relay/OpenEdge",
        "/nebula.v1.Relay/RenewEdges",
        "/nebula.v1.Relay/IssueEdgeTicket",
        "/nebula.v1.Data/ListDatasets",
        "/nebula.v1.Data/ReadBatch",
        "/nebula.v1.Auth/IssueJobToken",
    }
)
"""The only methods a job token may call: its job's edges (the switch checks the job), its batches,
and its own renewal (at auth, then of its edges at the switch). Anything else with a job token is
PERMISSION_DENIED, so a job token stolen from a running job is worth that job's traffic and nothing of
its account."""

INFRASTRUCTURE_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
"""Probes and reflection answer anyone who can reach the port: they reveal only names and liveness."""


def is_public(method: str) -> bool:
    """True for the methods that answer without a bearer token."""
    return method in PUBLIC_METHODS or method.startswith(INFRASTRUCTURE_PREFIXES)


def needs_admin(method: str) -> bool:
    return method in ADMIN_METHODS


def job_token_may_call(method: str) -> bool:
    """True for the methods a job token (``Principal.job_id`` set) is valid for."""
    return method in JOB_METHODS
