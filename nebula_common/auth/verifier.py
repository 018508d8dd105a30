"""Local verification of tokens issued by one cluster's auth service.

The switch and trainer of a cluster must only act for accounts of *their own*
cluster. They fetch the auth service's public keys once (GetSigningKeys) and then
check every token locally, so no call on the training path waits on the auth
service. Everything that could let a foreign or forged token through is pinned
here: the algorithm (ES256 only, so ``none`` and HS256-with-the-public-key
forgeries fail), the issuer (``nebula-auth/<cluster>``), the audience and the
signing key id.

Revocation without a round trip per call: the same GetSigningKeys reply carries the cluster's
token revocations (disabled, deleted accounts, password changes: "tokens of this account issued
before T are invalid") under an epoch that only grows. A verifier built from the auth service
refetches keys and revocations on a background thread every ``BACKGROUND_REFRESH_SECONDS``, so
a disabled account's token is refused everywhere within a few seconds; ``verify`` itself never
waits on the network except for the rate-limited refetch on an unknown key id.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import grpc
import jwt

from nebula_common.auth.key_source import (
    ALGORITHM,
    FETCH_TIMEOUT_SECONDS,
    ISSUER_PREFIX,
    AuthKeySource,
    KeySnapshot,
    Revocation,
    fetch_error,
    issuer_for,
    parse_jwks,
)
from nebula_common.auth.principal import AUDIENCE, JOB_ROLE, LEEWAY_SECONDS, Principal
from nebula_common.errors import AuthenticationError, NebulaError
from nebula_common.proto.nebula.v1 import auth_pb2, auth_pb2_grpc
from nebula_common.rpc.internal_tls import ClientTls, internal_channel

REFRESH_INTERVAL_SECONDS = 10.0
"""Least time between two key refetches: an unknown kid is either a rotation (refetch once) or
garbage (must not turn every forged token into a call to the auth service)."""

BACKGROUND_REFRESH_SECONDS = 2.0
"""How often a verifier built from the auth service refetches keys and revocations: the bound on
how long a disabled account's token keeps working (plus one fetch), at one small call per period."""

REQUIRED_CLAIMS = ("iss", "aud", "sub", "role", "cluster", "iat", "nbf", "exp", "jti")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _State:
    """Everything ``verify`` reads, swapped as one object so a reader never sees half an update."""

    keys: dict[str, jwt.PyJWK]
    epoch: int
    revocations: Mapping[str, Revocation]


class TokenVerifier:
    """Checks tokens of one cluster against that cluster's published signing keys and revocations."""

    def __init__(
        self,
        issuer_cluster_id: str,
        jwks_json: str,
        *,
        refresh: Callable[[], KeySnapshot] | None = None,
        refresh_interval_s: float = REFRESH_INTERVAL_SECONDS,
        revocation_epoch: int = 0,
        revocations: Mapping[str, Revocation] | None = None,
    ) -> None:
        if not issuer_cluster_id:
            raise ValueError("issuer_cluster_id must not be empty")
        self._cluster_id = issuer_cluster_id
        self._issuer = issuer_for(issuer_cluster_id)
        self._state = _State(
            parse_jwks(jwks_json), revocation_epoch, MappingProxyType(dict(revocations or {}))
        )
        self._refresh = refresh
        self._refresh_interval_s = refresh_interval_s
        self._last_refresh = float("-inf")  # the first unknown kid may refetch at once
        self._refresh_lock = threading.Lock()
        self._kid_fetch_lock = threading.Lock()
        self._last_success = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def apply(self, snapshot: KeySnapshot) -> bool:
        """Adopt a newer key set and revocation list; True if the key ids changed.

        A snapshot older than the revocations already enforced (lower epoch) is refused with
        ValueError: it would make revoked tokens valid again.
        """
        keys = parse_jwks(snapshot.jwks_json)
        with self._refresh_lock:
            current = self._state
            if snapshot.revocation_epoch < current.epoch:
                raise ValueError(
                    f"revocation epoch went back from {current.epoch} to {snapshot.revocation_epoch}"
                )
            self._state = _State(
                keys, snapshot.revocation_epoch, MappingProxyType(dict(snapshot.revocations))
            )
            self._last_success = time.monotonic()
        return set(keys) != set(current.keys)

    def _refresh_keys(self) -> bool:
        """Refetch the key set after a rotation; at most once per interval. True if keys changed."""
        if self._refresh is None:
            return False
        with self._kid_fetch_lock:
            now = time.monotonic()
            if now - self._last_refresh < self._refresh_interval_s:
                return False
            self._last_refresh = now
        try:
            return self.apply(self._refresh())
        except (NebulaError, ValueError) as exc:
            log.warning("token key refetch failed: %s", exc)
            return False

    def refresh_now(self) -> None:
        """Fetch keys and revocations once (the background thread's step); raises on failure."""
        if self._refresh is None:
            raise NebulaError("this verifier has no auth service to refresh from")
        self.apply(self._refresh())

    def start_background_refresh(self, interval_s: float = BACKGROUND_REFRESH_SECONDS) -> None:
        """Refetch keys and revocations every ``interval_s`` on a daemon thread until :meth:`close`.

        The thread holds the verifier only weakly, so a verifier dropped without ``close`` (the
        trainer never closes its own) still stops being polled once garbage collected.
        """
        if self._refresh is None:
            raise ValueError("background refresh needs a refresh source")
        if interval_s <= 0:
            raise ValueError("refresh interval must be positive")
        if self._thread is not None:
            return
        stop, ref = self._stop, weakref.ref(self)

        def run() -> None:
            while not stop.wait(interval_s):
                verifier = ref()
                if verifier is None:
                    return
                verifier._background_step()
                del verifier

        self._thread = threading.Thread(target=run, name=f"token-refresh-{self._cluster_id}", daemon=True)
        self._thread.start()

    def _background_step(self) -> None:
        try:
            self.refresh_now()
        except (NebulaError, ValueError) as exc:
            # Keep enforcing the last known revocations; say so once per outage, not every period.
            if not self._failing:
                log.warning("token revocation refresh failing, enforcing the last known list: %s", exc)
            self._failing = True
            return
        if self._failing:
            log.info("token revocation refresh recovered (epoch %d)", self._state.epoch)
        self._failing = False

    def close(self) -> None:
        """Stop the background refresh and release the connection to the auth service."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=FETCH_TIMEOUT_SECONDS + 1.0)
        closer = getattr(self._refresh, "close", None)
        if callable(closer):
            closer()

    @property
    def revocation_epoch(self) -> int:
        return self._state.epoch

    @property
    def revocations_age_s(self) -> float:
        """Seconds since keys and revocations were last fetched successfully (or built)."""
        return time.monotonic() - self._last_success

    @property
    def cluster_id(self) -> str:
        return self._cluster_id

    @property
    def issuer(self) -> str:
        return self._issuer

    @property
    def key_ids(self) -> frozenset[str]:
        return frozenset(self._state.keys)

    @classmethod
    def from_auth_service(
        cls, address: str, cluster_id: str, timeout: float = 5.0, *, tls: ClientTls | None = None
    ) -> TokenVerifier:
        """Fetch the signing keys of the auth service at ``address`` (its service port) once.

        Waits up to ``timeout`` for the service to become reachable, since a
        switch or trainer often starts alongside its auth service. ``tls`` is the
        caller's service identity (default: the process's own, see ``internal_tls``).
        """
        channel = internal_channel(address, service="auth", tls=tls)
        try:
            stub = auth_pb2_grpc.AuthStub(channel)
            try:
                reply = stub.GetSigningKeys(
                    auth_pb2.GetSigningKeysRequest(), timeout=timeout, wait_for_ready=True
                )
            except grpc.RpcError as exc:
                raise fetch_error(address, exc) from exc
        finally:
            channel.close()
        return cls._from_reply(address, cluster_id, reply, tls)

    @staticmethod
    def _refresher(address: str, cluster_id: str, tls: ClientTls | None = None) -> AuthKeySource:
        """A blocking fetch of keys and revocations (background thread, and unknown kids)."""
        return AuthKeySource(address, cluster_id, tls=tls)

    @classmethod
    async def from_auth_service_async(
        cls, address: str, cluster_id: str, timeout: float = 5.0, *, tls: ClientTls | None = None
    ) -> TokenVerifier:
        """Async twin of :meth:`from_auth_service` for aio servers (switch, trainer)."""
        channel = internal_channel(address, service="auth", tls=tls, aio=True)
        try:
            stub = auth_pb2_grpc.AuthStub(channel)
            try:
                reply = await stub.GetSigningKeys(
                    auth_pb2.GetSigningKeysRequest(), timeout=timeout, wait_for_ready=True
                )
            except grpc.RpcError as exc:
                raise fetch_error(address, exc) from exc
        finally:
            await channel.close()
        return cls._from_reply(address, cluster_id, reply, tls)

    @classmethod
    def _from_reply(
        cls, address: str, cluster_id: str, reply: auth_pb2.SigningKeys, tls: ClientTls | None = None
    ) -> TokenVerifier:
        # A misrouted address (the other cluster's auth service) must not make
        # this cluster accept the other cluster's accounts.
        expected = issuer_for(cluster_id)
        if reply.issuer != expected:
            raise AuthenticationError(
                f"auth service at {address} issues tokens as {reply.issuer!r}, expected {expected!r}"
            )
        try:
            snapshot = KeySnapshot.from_reply(reply)
        except ValueError as exc:
            raise AuthenticationError(f"auth service at {address} sent invalid revocations: {exc}") from exc
        verifier = cls(
            cluster_id,
            snapshot.jwks_json,
            refresh=cls._refresher(address, cluster_id, tls),
            revocation_epoch=snapshot.revocation_epoch,
            revocations=snapshot.revocations,
        )
        verifier.start_background_refresh()
        return verifier

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
        key = self._state.keys.get(kid)
        if key is None and self._refresh_keys():
            key = self._state.keys.get(kid)
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
        principal = self._principal(claims)
        self._check_revocation(principal.username, claims["iat"])
        return principal

    def revocation_reason(self, username: str, issued_at: float) -> str | None:
        """Why a token of ``username`` issued at ``issued_at`` is no longer good (account disabled,
        deleted, new password), or None. For what outlives one call: a live edge is checked with it."""
        try:
            self._check_revocation(username, issued_at)
        except AuthenticationError as exc:
            return str(exc)
        return None

    def _check_revocation(self, username: str, issued_at: Any) -> None:
        """Refuse a token issued before its account was disabled, deleted or given a new password."""
        revocation = self._state.revocations.get(username)
        if revocation is None:
            return
        if not isinstance(issued_at, int | float) or issued_at * 1000 < revocation.not_before_ms:
            raise AuthenticationError(f"token revoked: {revocation.reason}")

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
        job = claims.get("job", "")
        if not isinstance(job, str) or (role == JOB_ROLE) != bool(job):
            raise AuthenticationError("malformed token: a job token names one job, an account token none")
        issued, expires = claims.get("iat"), claims.get("exp")
        return Principal(
            username=username,
            role=role,
            cluster_id=self._cluster_id,
            job_id=job,
            issued_at=float(issued) if isinstance(issued, int | float) else 0.0,
            expires_at=float(expires) if isinstance(expires, int | float) else 0.0,
        )
