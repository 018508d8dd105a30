"""The auth service (``nebula-auth``): accounts, tokens and the bootstrap admin of one cluster.

The service listens only on the cluster-internal network, so its gRPC port is
plaintext; the first admin is seeded from a file at start-up because there is
deliberately no open sign-up endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from argon2 import PasswordHasher

from nebula_common.audit import AuditLog
from nebula_common.audit.servicer import AUDIT_SERVICE_NAME, add_audit_api
from nebula_common.auth.interceptor import TokenAuthInterceptor
from nebula_common.errors import InvalidRequestError
from nebula_common.proto.nebula.v1 import auth_pb2_grpc
from nebula_common.rpc import ServiceServer
from nebula_common.service.host import ServiceDefinition, Started, acquire_in_thread
from nebula_common.service.identity import service_identity
from nebula_common.service.resources import (
    grpc_server,
    internal_server_options,
    service_audit,
    start_internal,
)
from services.auth import metrics
from services.auth.config import AuthSettings
from services.auth.passwords import hash_password, make_hasher, validate_new_account
from services.auth.servicer import AuthServicer
from services.auth.store import AccountExistsError, AccountStore
from services.auth.tokens import TokenIssuer

logger = logging.getLogger(__name__)

SERVICE_NAME = "nebula.v1.Auth"
DB_FILE_NAME = "accounts.db"
STOP_GRACE_SECONDS = 5.0


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


def _open_store(settings: AuthSettings) -> AccountStore:
    return AccountStore(settings.data_dir / DB_FILE_NAME)


async def start_auth(settings: AuthSettings, stack: contextlib.AsyncExitStack) -> Started[ServiceServer]:
    """Audit log, account store, signing key and bootstrap admin, then the server; released in reverse.

    Blocking set-up (files, key generation, argon2) runs in worker threads so a
    stop signal during start-up is still handled at once.
    """
    hasher = make_hasher(
        time_cost=settings.argon2_time_cost,
        memory_cost_kib=settings.argon2_memory_cost_kib,
        parallelism=settings.argon2_parallelism,
    )
    identity = await service_identity(stack, settings, "auth")
    settings.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    audit = await service_audit(
        stack,
        settings.data_dir,
        service="auth",
        cluster=settings.cluster_id,
        signer=settings.audit_signer,
    )
    store = await acquire_in_thread(stack, lambda: _open_store(settings), AccountStore.close)
    issuer = await asyncio.to_thread(
        TokenIssuer,
        settings.data_dir,
        settings.cluster_id,
        settings.token_ttl_seconds,
        settings.job_token_ttl_seconds,
    )
    await asyncio.to_thread(ensure_bootstrap_admin, store, settings, hasher, audit)
    servicer = AuthServicer(
        store,
        issuer,
        audit,
        hasher,
        max_failed_logins=settings.max_failed_logins,
        lockout_seconds=settings.lockout_seconds,
    )
    interceptor = TokenAuthInterceptor(
        "auth",
        servicer.current_verifier,
        audit=audit,
        account_check=servicer.account_check,
        admin_check=servicer.admin_check,
    )
    server = grpc_server(
        stack,
        [SERVICE_NAME, AUDIT_SERVICE_NAME],
        grace=STOP_GRACE_SECONDS,
        interceptors=[*identity.interceptors(audit), interceptor],
        options=internal_server_options(),
    )
    auth_pb2_grpc.add_AuthServicer_to_server(servicer, server.server)
    add_audit_api(server, audit, "auth", settings.cluster_id)
    ports = await start_internal(server, identity, settings, settings.listen)
    logger.info(
        "auth service started",
        extra={
            "fields": {
                "cluster_id": settings.cluster_id,
                "issuer": issuer.issuer,
                "kid": issuer.kid,
                **ports,
                "accounts": store.count(),
            }
        },
    )
    return Started(server, ports)


SERVICE = ServiceDefinition("auth", AuthSettings, start_auth)
