"""Where a verifier's keys come from: the auth service's signing keys and token revocations.

A verifier trusts exactly what GetSigningKeys of its own cluster's auth service answers: public
ES256 keys (a set holding anything else, private material included, is refused whole, not
filtered) and the revocations in force at an epoch that only grows. ``AuthKeySource`` is the
blocking fetch the verifier's refresh thread polls over one channel kept open between polls.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc
import jwt

from nebula_common.errors import NebulaError
from nebula_common.proto.nebula.v1 import auth_pb2, auth_pb2_grpc
from nebula_common.rpc.internal_tls import ClientTls, internal_channel

ISSUER_PREFIX = "nebula-auth/"
"""Tokens name their issuer ``nebula-auth/<cluster>``: a verifier accepts only its own cluster's auth."""
ALGORITHM = "ES256"
"""The only signature algorithm tokens may use; pinned so header tricks cannot pick another."""

FETCH_TIMEOUT_SECONDS = 2.0
"""Deadline of one refetch, so a hung auth service cannot pile up work in the refresh thread."""


def issuer_for(cluster_id: str) -> str:
    """The ``iss`` claim the auth service of ``cluster_id`` puts in its tokens."""
    return ISSUER_PREFIX + cluster_id


@dataclass(frozen=True)
class Revocation:
    """Tokens of one account whose ``iat`` is before ``not_before_ms`` are refused, saying ``reason``."""

    not_before_ms: int
    reason: str


@dataclass(frozen=True)
class KeySnapshot:
    """One GetSigningKeys answer: the key set plus the revocations in force at ``revocation_epoch``."""

    jwks_json: str
    revocation_epoch: int = 0
    revocations: Mapping[str, Revocation] = field(default_factory=dict)

    @classmethod
    def from_reply(cls, reply: auth_pb2.SigningKeys) -> KeySnapshot:
        revocations: dict[str, Revocation] = {}
        for entry in reply.revocations:
            if not entry.username:
                raise ValueError("token revocation without a username")
            revocations[entry.username] = Revocation(
                int(entry.not_before_ms), entry.reason or "token revoked"
            )
        return cls(str(reply.jwks_json), int(reply.revocation_epoch), revocations)


def parse_jwks(jwks_json: str) -> dict[str, jwt.PyJWK]:
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


class AuthKeySource:
    """Fetches keys and revocations from one auth service over a channel kept open between polls.

    Blocking; used from the verifier's refresh thread and (rate-limited) from ``verify`` on an
    unknown key id. Each call has a short deadline so an unreachable service costs at most that.
    """

    def __init__(self, address: str, cluster_id: str, *, tls: ClientTls | None = None) -> None:
        self._address = address
        self._cluster_id = cluster_id
        self._tls = tls
        self._channel = internal_channel(address, service="auth", tls=tls)
        self._stub = auth_pb2_grpc.AuthStub(self._channel)

    def __call__(self) -> KeySnapshot:
        try:
            reply = self._stub.GetSigningKeys(auth_pb2.GetSigningKeysRequest(), timeout=FETCH_TIMEOUT_SECONDS)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                # A new channel presents the certificate on disk now (the old one keeps the
                # credentials it was built with, which a renewal has since replaced).
                self._channel.close()
                self._channel = internal_channel(self._address, service="auth", tls=self._tls)
                self._stub = auth_pb2_grpc.AuthStub(self._channel)
            raise fetch_error(self._address, exc) from exc
        if reply.issuer != issuer_for(self._cluster_id):
            raise NebulaError(f"auth service at {self._address} now issues as {reply.issuer!r}")
        return KeySnapshot.from_reply(reply)

    def close(self) -> None:
        self._channel.close()


def fetch_error(address: str, exc: grpc.RpcError) -> NebulaError:
    # Sync errors are grpc.Call instances, aio ones are AioRpcError; both have code()/details().
    code = exc.code() if isinstance(exc, grpc.Call | grpc.aio.AioRpcError) else None
    details = exc.details() if isinstance(exc, grpc.Call | grpc.aio.AioRpcError) else str(exc)
    name = code.name if code is not None else "error"
    return NebulaError(f"could not fetch signing keys from auth service at {address}: {name}: {details}")
