"""Process entry point of the auth service (``nebula-auth``).

The service listens only on the cluster-internal network, so its gRPC port is
plaintext; the first admin is seeded from a file at start-up because there is
deliberately no open sign-up endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass

from argon2 import PasswordHasher
from pydantic import ValidationError

from nebula_common.audit import AuditLog, open_service_audit
from nebula_common.audit.servicer import AuditServicer
from nebula_common.auth.verifier import Principal
from nebula_common.errors import InvalidRequestError
from nebula_common.logging import configure_logging
from nebula_common.proto.nebula.v1 import audit_pb2_grpc, auth_pb2_grpc
from nebula_common.rpc import ServiceServer, create_server
from nebula_common.rpc.lifecycle import serve_until_signalled
from services.auth import metrics
from services.auth.config import AuthSettings
from services.auth.passwords import hash_password, make_hasher, validate_new_account
from services.auth.servicer import AuthServicer
from services.auth.store import AccountExistsError, AccountStore
from services.auth.tokens import TokenIssuer

logger = logging.getLogger(__name__)

SERVICE_NAME = "nebula.v1.Auth"
AUDIT_SERVICE_NAME = "nebula.v1.AuditLog"
DB_FILE_NAME = "accounts.db"
STOP_GRACE_SECONDS = 5.0


@dataclass
class AuthServer(ServiceServer):
    """The auth gRPC server plus the account database it must close when it stops."""

    store: AccountStore | None = None
    audit: AuditLog | None = None

    @property
    def grpc_port(self) -> int:
        return self.ports["grpc"]

    async def stop(self, grace: float = 2.0) -> None:
        await super().stop(grace)
        if self.store is not None:
            self.store.close()
            self.store = None
        if self.audit is not None:
            await asyncio.to_thread(self.audit.close)  # seals the tail
            self.audit = None


def ensure_bootstrap_admin(
    store: AccountStore, settings: AuthSettings, hasher: PasswordHasher, audit: AuditLog | None = None
) -> bool:
    """Create the configured admin from its password file if it does not exist yet.

    Returns True when an account was created. An existing account is never
    touched, so rotating the file later cannot silently reset a password.
    """
    if settings.admin_password_file is None:
        return False
    username = settings.admin_username
    existing = store.get(username)
    if existing is not None:
        if existing.role != "admin":
            logger.warning(
                "bootstrap admin name belongs to a non-admin account",
                extra={"fields": {"username": username, "role": existing.role}},
            )
        return False
    try:
        password = settings.admin_password_file.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise RuntimeError(f"cannot read admin password file {settings.admin_password_file}: {exc}") from exc
    try:
        validate_new_account(username, password, "admin")
    except InvalidRequestError as exc:
        raise RuntimeError(f"bootstrap admin from {settings.admin_password_file} rejected: {exc}") from exc
    try:
        store.create(username, hash_password(password, hasher), "admin")
    except AccountExistsError:
        return False  # another replica seeded it between our check and insert
    metrics.ACCOUNTS_CREATED.inc()
    if audit is not None:
        audit.append("account.create", account="bootstrap", details={"target": username, "role": "admin"})
    logger.info(
        "account created",
        extra={
            "fields": {
                "event": "account_created",
                "cluster_id": settings.cluster_id,
                "username": username,
                "role": "admin",
                "created_by": "bootstrap",
            }
        },
    )
    return True


def _build(settings: AuthSettings) -> tuple[AccountStore, TokenIssuer, AuthServicer, AuditLog]:
    """Blocking set-up (files, key generation, argon2) kept off the event loop."""
    settings.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    hasher = make_hasher(
        time_cost=settings.argon2_time_cost,
        memory_cost_kib=settings.argon2_memory_cost_kib,
        parallelism=settings.argon2_parallelism,
    )
    audit = open_service_audit(
        settings.data_dir,
        service="auth",
        cluster=settings.cluster_id,
        seal_interval_s=settings.audit_seal_interval_s,
    )
    try:
        store = AccountStore(settings.data_dir / DB_FILE_NAME)
    except BaseException:
        audit.close()
        raise
    try:
        issuer = TokenIssuer(settings.data_dir, settings.cluster_id, settings.token_ttl_seconds)
        ensure_bootstrap_admin(store, settings, hasher, audit)
        servicer = AuthServicer(
            store,
            issuer,
            audit,
            hasher,
            max_failed_logins=settings.max_failed_logins,
            lockout_seconds=settings.lockout_seconds,
        )
    except BaseException:
        store.close()
        audit.close()
        raise
    return store, issuer, servicer, audit


async def run_auth_server(settings: AuthSettings) -> AuthServer:
    """Open the data dir, seed the admin, and start serving; the caller owns ``stop()``."""
    store, issuer, servicer, audit = await asyncio.to_thread(_build, settings)
    base = create_server([SERVICE_NAME, AUDIT_SERVICE_NAME])
    server = AuthServer(
        server=base.server, health=base.health, service_names=base.service_names, store=store, audit=audit
    )

    async def account_is_live_admin(principal: Principal) -> str | None:
        # A token outlives a disabled, demoted or deleted account: re-read the account itself.
        record = await asyncio.to_thread(store.get, principal.username)
        if record is None or record.disabled or record.role != "admin":
            return "account is no longer an enabled admin"
        return None

    try:
        auth_pb2_grpc.add_AuthServicer_to_server(servicer, server.server)
        audit_pb2_grpc.add_AuditLogServicer_to_server(
            AuditServicer(
                audit, servicer.current_verifier, "auth", settings.cluster_id, account_is_live_admin
            ),
            server.server,
        )
        server.add_insecure_port("grpc", settings.listen)
        server.start_metrics(settings.metrics_port, settings.listen)
        await server.start()
    except BaseException:
        await server.stop(0)
        raise
    logger.info(
        "auth service started",
        extra={
            "fields": {
                "cluster_id": settings.cluster_id,
                "issuer": issuer.issuer,
                "kid": issuer.kid,
                "grpc_port": server.grpc_port,
                "metrics_port": server.metrics_port,
                "accounts": store.count(),
            }
        },
    )
    return server


async def _serve(settings: AuthSettings) -> None:
    server = await run_auth_server(settings)
    ready = {"service": "auth", "grpc_port": server.grpc_port, "metrics_port": server.metrics_port}
    await serve_until_signalled(ready, lambda: server.stop(STOP_GRACE_SECONDS))


def main() -> None:
    try:
        settings = AuthSettings()
    except ValidationError as exc:
        sys.stderr.write(f"nebula-auth: invalid configuration: {exc}\n")
        raise SystemExit(2) from None
    configure_logging("auth", settings.log_level)
    try:
        asyncio.run(_serve(settings))
    except (RuntimeError, OSError, ValueError) as exc:
        logger.error("auth service failed", extra={"fields": {"error": str(exc)}})
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
