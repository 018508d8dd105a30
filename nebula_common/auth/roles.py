"""Which service identity may call which RPC: the one role matrix of the cluster-internal ports.

Written once, next to the interceptors that enforce it (``peer_roles.PeerRoleInterceptor``), on
top of the bearer-token table (``policy.py``), which stays: a call must pass both.

Every method is listed explicitly (no per-service default), so a new RPC has no access until
someone decides who needs it; ``tests/unit/test_role_matrix.py`` walks every service descriptor
and fails on a method missing here, or on a name here that no proto defines.

Each entry says:

* ``roles``: the service identities (``spiffe://nebula/cluster/<id>/<role>``) whose client
  certificate may call the method on a service port (mutual TLS);
* ``users``: whether the method is **user-facing**. Users hold no service certificate; they call on
  the client port (TLS, no client certificate; their bearer token is the credential) or, with an
  optional ``operator`` certificate of the cluster, on either port. A method that is not
  user-facing is **service-only**: it needs a service certificate of a listed role.

So "who is calling" is answered by the TLS handshake (a certificate, or none) and the entry tells
user-facing from service-only methods; nothing in the request can change the answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

OPERATOR_ROLE = "operator"
"""A user's optional client certificate (``nebula pki issue --role operator``): a user, not a service."""


@dataclass(frozen=True)
class Access:
    """Who may call one method (see the module docstring)."""

    roles: frozenset[str]
    users: bool
    why: str


def _user(why: str, *roles: str) -> Access:
    return Access(frozenset(roles), True, why)


def _service(why: str, *roles: str) -> Access:
    if not roles:
        raise ValueError("a service-only method needs at least one role")
    return Access(frozenset(roles), False, why)


_VERIFIERS = ("switch", "trainer", "data", "codec")
"""Services that verify bearer tokens locally with auth's keys (``TokenVerifier``)."""

ROLE_MATRIX: MappingProxyType[str, Access] = MappingProxyType(
    {
        # --- auth -----------------------------------------------------------------------------
        "/nebula.v1.Auth/Login": _user("users log in (CLI, SDK)"),
        "/nebula.v1.Auth/VerifyToken": _user("a user or a verifying service checks one token", *_VERIFIERS),
        "/nebula.v1.Auth/GetSigningKeys": _service(
            "every token verifier fetches the public keys and revocations", *_VERIFIERS
        ),
        "/nebula.v1.Auth/CreateAccount": _user("admins manage accounts (nebula account)"),
        "/nebula.v1.Auth/ListAccounts": _user("admins manage accounts (nebula account)"),
        "/nebula.v1.Auth/DisableAccount": _user("admins manage accounts (nebula account)"),
        "/nebula.v1.Auth/EnableAccount": _user("admins manage accounts (nebula account)"),
        "/nebula.v1.Auth/DeleteAccount": _user("admins manage accounts (nebula account)"),
        "/nebula.v1.Auth/ChangePassword": _user("users change their own password"),
        "/nebula.v1.Auth/RotateSigningKey": _user("admins rotate the signing key"),
        "/nebula.v1.Auth/IssueJobToken": _service(
            "the trainer trades a submitter's token for a job-scoped one and renews it", "trainer"
        ),
        # --- audit (served by auth, data, switch and trainer) -----------------------------------
        "/nebula.v1.AuditLog/Query": _user("admins read a service's audit log (nebula audit query)"),
        "/nebula.v1.AuditLog/GetAuditKey": _user("admins fetch the key that seals the audit log"),
        # --- audit signer: served only on one Unix socket per service, never on a TLS port ------------
        "/nebula.v1.AuditSigner/GetSealKey": _service(
            "the service whose log it seals, on its own socket", "auth", "data", "switch", "trainer"
        ),
        "/nebula.v1.AuditSigner/SignSeal": _service(
            "the service whose log it seals, on its own socket", "auth", "data", "switch", "trainer"
        ),
        # --- codec --------------------------------------------------------------------------------
        "/nebula.v1.Codec/Encode": _user("off-box compression for users and the trainer", "trainer"),
        "/nebula.v1.Codec/Decode": _user("off-box compression for users and the trainer", "trainer"),
        "/nebula.v1.Codec/ListCodecs": _user("off-box compression for users and the trainer", "trainer"),
        "/nebula.v1.Codec/EncodeStream": _user("off-box compression for users and the trainer", "trainer"),
        "/nebula.v1.Codec/DecodeStream": _user("off-box compression for users and the trainer", "trainer"),
        "/nebula.v1.Codec/Advise": _user("the SDK resolves codec: auto before submitting", "trainer"),
        # --- data ---------------------------------------------------------------------------------
        "/nebula.v1.Data/UploadDataset": _user("owners manage their datasets (nebula data)"),
        "/nebula.v1.Data/ImportDataset": _user("owners manage their datasets (nebula data)"),
        "/nebula.v1.Data/ListDatasets": _user(
            "owners list their datasets; a stage looks up the dataset it was granted (GrantedBatchSource)",
            "trainer",
        ),
        "/nebula.v1.Data/DeleteDataset": _user("owners manage their datasets (nebula data)"),
        "/nebula.v1.Data/DownloadDataset": _user("owners manage their datasets (nebula data)"),
        "/nebula.v1.Data/Grant": _user("owners manage their datasets (nebula data)"),
        "/nebula.v1.Data/Revoke": _user("owners manage their datasets (nebula data)"),
        "/nebula.v1.Data/ListGrants": _user("owners manage their datasets (nebula data)"),
        "/nebula.v1.Data/ReadBatch": _user("a stage reads granted records (trainer), or a user", "trainer"),
        # --- switch, internal port ----------------------------------------------------------------
        "/nebula.v1.Relay/OpenEdge": _service("only a trainer opens a job's edge to its switch", "trainer"),
        "/nebula.v1.Relay/RenewEdges": _service(
            "the trainer moves a running job's edges onto its renewed token", "trainer"
        ),
        "/nebula.v1.Relay/IssueEdgeTicket": _service(
            "only a trainer opens a job's edge to its switch (as records on the edge socket)", "trainer"
        ),
        "/nebula.v1.Relay/GetLinkStatus": _user(
            "the SDK's job summary and operators read link state; the trainer may too", "trainer"
        ),
        # --- switch, WAN port (mutual TLS with the *peer* CA; checked in services/switch/link_handshake.py)
        "/nebula.v1.SwitchLink/Link": _service("the peer cluster's switch, on the WAN port only", "switch"),
        "/nebula.v1.SwitchTrust/ExchangeCrl": _service(
            "the peer cluster's switch sends its CA's CRL, WAN port only (switch/peer_trust.py)",
            "switch",
        ),
        # --- trainer ------------------------------------------------------------------------------
        "/nebula.v1.Trainer/AssignStage": _user("users submit their stage (SDK, nebula job)"),
        "/nebula.v1.Trainer/WatchStage": _user("users follow their stage"),
        "/nebula.v1.Trainer/CancelStage": _user("users cancel their stage"),
        "/nebula.v1.Trainer/ListCheckpoints": _user("users list their checkpoints"),
        "/nebula.v1.Trainer/ListStages": _user("users list their stages (nebula job list)"),
    }
)
"""Full method name -> who may call it. Not listed: refused (default deny)."""

INFRASTRUCTURE_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
"""Probes and reflection answer anyone who completed the handshake: they reveal only names and liveness."""


def refusal(method: str, role: str | None) -> str | None:
    """Why a caller with certificate role ``role`` (None: no client certificate) may not call ``method``.

    None means allowed. The reason is what the caller is told and what the audit record says.
    """
    if method.startswith(INFRASTRUCTURE_PREFIXES):
        return None
    access = ROLE_MATRIX.get(method)
    if access is None:
        return f"{method} is not in the role matrix (default deny)"
    if role is None:
        if access.users:
            return None
        return (
            f"{method} is service-only: it needs a client certificate of role "
            f"{' or '.join(sorted(access.roles))} (call the service port with mutual TLS)"
        )
    if role in access.roles or (role == OPERATOR_ROLE and access.users):
        return None
    allowed = sorted(access.roles) + (["users"] if access.users else [])
    return f"role {role!r} may not call {method} (allowed: {', '.join(allowed)})"
