"""Local verification of tokens issued by one cluster's auth service.

The switch and trainer of a cluster must only act for accounts of *their own*
cluster. They fetch the auth service's public keys once (GetSigningKeys) and then
check every token locally, so no call on the training path waits on the auth
service. Everything that could let a foreign or forged token through is pinned
here: the algorithm (ES256 only, so ``none`` and HS256-with-the-public-key
forgeries fail), the issuer (``nebula-auth/<cluster>``), the audience and the
signing key id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import grpc
import jwt

from nebula_common.errors import AuthenticationError, NebulaError
from nebula_common.proto.nebula.v1 import auth_pb2, auth_pb2_grpc
from nebula_common.rpc import insecure_channel

ALGORITHM = "ES256"
"""The only signature algorithm tokens may use; pinned so header tricks cannot pick another."""

AUDIENCE = "nebula"
ISSUER_PREFIX = "nebula-auth/"
LEEWAY_SECONDS = 30
"""Clock skew tolerated on exp/nbf/iat: the clusters' clocks are not perfectly in sync."""

REQUIRED_CLAIMS = ("iss", "aud", "sub", "role", "cluster", "iat", "nbf", "exp", "jti")


def issuer_for(cluster_id: str) -> str:
    """The ``iss`` claim the auth service of ``cluster_id`` puts in its tokens."""
    return ISSUER_PREFIX + cluster_id


@dataclass(frozen=True)
class Principal:
    """Who authorised a call: an account of ``cluster_id`` with ``role``."""

    username: str
    role: str
    cluster_id: str


class TokenVerifier:
    """Checks tokens of one cluster against that cluster's published signing keys."""

    def __init__(self, issuer_cluster_id: str, jwks_json: str) -> None:
        if not issuer_cluster_id:
            raise ValueError("issuer_cluster_id must not be empty")
        self._cluster_id = issuer_cluster_id
        self._issuer = issuer_for(issuer_cluster_id)
        self._keys = _parse_jwks(jwks_json)

    @property
    def cluster_id(self) -> str:
        return self._cluster_id

    @property
    def issuer(self) -> str:
        return self._issuer

    @property
    def key_ids(self) -> frozenset[str]:
        return frozenset(self._keys)

    @classmethod
    def from_auth_service(cls, address: str, cluster_id: str, timeout: float = 5.0) -> TokenVerifier:
        """Fetch the signing keys of the auth service at ``address`` once.

        Waits up to ``timeout`` for the service to become reachable, since a
        switch or trainer often starts alongside its auth service.
        """
        channel = insecure_channel(address)
        try:
            stub = auth_pb2_grpc.AuthStub(channel)
            try:
                reply = stub.GetSigningKeys(
                    auth_pb2.GetSigningKeysRequest(), timeout=timeout, wait_for_ready=True
                )
            except grpc.RpcError as exc:
                raise _fetch_error(address, exc) from exc
        finally:
            channel.close()
        return cls._from_reply(address, cluster_id, reply)

    @classmethod
    async def from_auth_service_async(
        cls, address: str, cluster_id: str, timeout: float = 5.0
    ) -> TokenVerifier:
        """Async twin of :meth:`from_auth_service` for aio servers (switch, trainer)."""
        channel = insecure_channel(address, aio=True)
        try:
            stub = auth_pb2_grpc.AuthStub(channel)
            try:
                reply = await stub.GetSigningKeys(
                    auth_pb2.GetSigningKeysRequest(), timeout=timeout, wait_for_ready=True
                )
            except grpc.RpcError as exc:
                raise _fetch_error(address, exc) from exc
        finally:
            await channel.close()
        return cls._from_reply(address, cluster_id, reply)

    @classmethod
    def _from_reply(cls, address: str, cluster_id: str, reply: auth_pb2.SigningKeys) -> TokenVerifier:
        # A misrouted address (the other cluster's auth service) must not make
        # this cluster accept the other cluster's accounts.
        expected = issuer_for(cluster_id)
        if reply.issuer != expected:
            raise AuthenticationError(
                f"auth service at {address} issues tokens as {reply.issuer!r}, expected {expected!r}"
            )
        return cls(cluster_id, reply.jwks_json)

    def verify(self, token: str) -> Principal:
        """Return the token's principal, or raise AuthenticationError saying why it is rejected."""
        if not isinstance(token, str) or not token:
            raise AuthenticationError("malformed token")
        try:
            header = jwt.get_unverified_header(token)
            unverified = jwt.decode(token, options={"verify_signature": False})
        except jwt.PyJWTError as exc:
            raise AuthenticationError("malformed token") from exc

        alg = header.get("alg")
        if alg != ALGORITHM:
            raise AuthenticationError(f"token algorithm {alg!r} not accepted, expected {ALGORITHM}")
        # Checked before the key lookup so a token of the other cluster gets a
        # reason that says so instead of "unknown signing key id".
        self._check_issuer(unverified.get("iss"))
        kid = header.get("kid")
        if not isinstance(kid, str) or not kid:
            raise AuthenticationError("token has no signing key id")
        key = self._keys.get(kid)
        if key is None:
            raise AuthenticationError(f"unknown signing key id {kid!r} for issuer {self._issuer}")

        try:
            claims = jwt.decode(
                token,
                key=key.key,
                algorithms=[ALGORITHM],
                audience=AUDIENCE,
                issuer=self._issuer,
                leeway=LEEWAY_SECONDS,
                options={"require": list(REQUIRED_CLAIMS)},
            )
        except jwt.ExpiredSignatureError as exc:
            raise AuthenticationError("token expired") from exc
        except jwt.ImmatureSignatureError as exc:
            raise AuthenticationError("token not yet valid") from exc
        except jwt.InvalidAudienceError as exc:
            raise AuthenticationError(f"token audience is not {AUDIENCE!r}") from exc
        except jwt.InvalidSignatureError as exc:
            raise AuthenticationError("invalid token signature") from exc
        except jwt.MissingRequiredClaimError as exc:
            raise AuthenticationError(f"token lacks required claim {exc.claim!r}") from exc
        except jwt.PyJWTError as exc:
            raise AuthenticationError(f"malformed token: {exc}") from exc
        return self._principal(claims)

    def _check_issuer(self, iss: Any) -> None:
        if iss == self._issuer:
            return
        if isinstance(iss, str) and iss.startswith(ISSUER_PREFIX):
            other = iss[len(ISSUER_PREFIX) :]
            raise AuthenticationError(f"token issued by cluster {other}, expected {self._cluster_id}")
        raise AuthenticationError(f"token issuer {iss!r} is not {self._issuer!r}")

    def _principal(self, claims: dict[str, Any]) -> Principal:
        username, role, cluster = claims.get("sub"), claims.get("role"), claims.get("cluster")
        if not isinstance(username, str) or not username:
            raise AuthenticationError("malformed token: empty subject")
        if not isinstance(role, str) or not role:
            raise AuthenticationError("malformed token: empty role")
        # The signed issuer already names the cluster; a disagreeing claim means
        # the issuer is broken, so refuse rather than guess which one is right.
        if cluster != self._cluster_id:
            raise AuthenticationError(f"token cluster claim {cluster!r} does not match issuer {self._issuer}")
        return Principal(username=username, role=role, cluster_id=self._cluster_id)


def _parse_jwks(jwks_json: str) -> dict[str, jwt.PyJWK]:
    """Index the ES256 keys of a JWK set by kid; anything else in it is an error, not ignored."""
    try:
        document = json.loads(jwks_json)
    except (TypeError, ValueError) as exc:
        raise ValueError("signing keys are not valid JSON") from exc
    entries = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError("signing keys must be a JWK set with at least one key")
    keys: dict[str, jwt.PyJWK] = {}
    for entry in entries:
        if not isinstance(entry, dict):
            raise ValueError("signing key entry is not an object")
        kid = entry.get("kid")
        if not isinstance(kid, str) or not kid:
            raise ValueError("signing key has no kid")
        if entry.get("kty") != "EC" or entry.get("crv") != "P-256":
            raise ValueError(f"signing key {kid!r} is not an EC P-256 key")
        if entry.get("alg", ALGORITHM) != ALGORITHM:
            raise ValueError(f"signing key {kid!r} is for {entry.get('alg')!r}, expected {ALGORITHM}")
        if "d" in entry:
            raise ValueError(f"signing key {kid!r} contains private key material")
        try:
            keys[kid] = jwt.PyJWK(entry, algorithm=ALGORITHM)
        except jwt.PyJWTError as exc:
            raise ValueError(f"signing key {kid!r} is invalid: {exc}") from exc
    return keys


def _fetch_error(address: str, exc: grpc.RpcError) -> NebulaError:
    # Sync errors are grpc.Call instances, aio ones are AioRpcError; both have code()/details().
    code = exc.code() if isinstance(exc, grpc.Call | grpc.aio.AioRpcError) else None
    details = exc.details() if isinstance(exc, grpc.Call | grpc.aio.AioRpcError) else str(exc)
    name = code.name if code is not None else "error"
    return NebulaError(f"could not fetch signing keys from auth service at {address}: {name}: {details}")
