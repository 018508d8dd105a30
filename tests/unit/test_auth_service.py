"""The auth service end to end in-process: a real aio server on 127.0.0.1:0, called via the SDK client.

The server runs on its own event loop in a background thread so the tests can
use the synchronous AuthClient and TokenVerifier.from_auth_service, as the CLI
and the services' start-up code do.
"""

from __future__ import annotations

import asyncio
import sqlite3
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY
from pydantic import ValidationError

from nebula_common.auth import Principal, TokenVerifier
from nebula_common.errors import AuthenticationError, InvalidRequestError, PermissionDeniedError
from nebula_common.proto.nebula.v1 import auth_pb2, auth_pb2_grpc
from nebula_common.sdk.auth_client import AccountExistsError, AuthClient
from nebula_common.service.settings import describe_validation_error
from services.auth.config import AuthSettings
from tests.support.accounts import ADMIN_PASSWORD
from tests.support.servers import AuthServerThread

USER_PASSWORD = "alice-has-a-long-password"


def _settings(data_dir: Path, password_file: Path | None) -> AuthSettings:
    return AuthSettings(
        cluster_id="a",
        data_dir=data_dir,
        listen="127.0.0.1:0",
        admin_password_file=password_file,
        metrics_port=-1,
    )


@pytest.fixture
def password_file(tmp_path: Path) -> Path:
    path = tmp_path / "admin-password"
    path.write_text(f"  {ADMIN_PASSWORD}\n")
    return path


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def auth(data_dir: Path, password_file: Path) -> Iterator[AuthServerThread]:
    running = AuthServerThread(_settings(data_dir, password_file))
    yield running
    running.stop()


@pytest.fixture
def client(auth: AuthServerThread) -> Iterator[AuthClient]:
    with AuthClient(auth.address) as sdk:
        yield sdk


def _metric(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


@pytest.mark.timeout(60)
def test_admin_login(client: AuthClient) -> None:
    successes = _metric("nebula_auth_logins_total", {"outcome": "success"})
    issued = _metric("nebula_auth_tokens_issued_total")
    result = client.login("admin", ADMIN_PASSWORD)
    assert result.token.count(".") == 2
    assert result.expires_at > 0
    status = client.verify(result.token)
    assert (status.valid, status.username, status.role, status.cluster_id) == (True, "admin", "admin", "a")
    assert _metric("nebula_auth_logins_total", {"outcome": "success"}) == successes + 1
    assert _metric("nebula_auth_tokens_issued_total") == issued + 1


@pytest.mark.timeout(60)
def test_admin_creates_user_who_logs_in_and_verifies_locally(
    auth: AuthServerThread, client: AuthClient
) -> None:
    created = _metric("nebula_auth_accounts_created_total")
    admin_token = client.login("admin", ADMIN_PASSWORD).token
    account = client.create_account(admin_token, "alice", USER_PASSWORD)
    assert (account.username, account.role, account.cluster_id) == ("alice", "user", "a")
    assert account.created_at > 0
    assert _metric("nebula_auth_accounts_created_total") == created + 1

    user_token = client.login("alice", USER_PASSWORD).token
    verifier = TokenVerifier.from_auth_service(auth.address, "a")
    assert verifier.verify(user_token) == Principal(username="alice", role="user", cluster_id="a")

    async_verifier = asyncio.run(TokenVerifier.from_auth_service_async(auth.address, "a"))
    assert async_verifier.verify(user_token).username == "alice"


@pytest.mark.timeout(60)
def test_verifier_refuses_auth_service_of_other_cluster(auth: AuthServerThread) -> None:
    with pytest.raises(AuthenticationError, match="nebula-auth/a"):
        TokenVerifier.from_auth_service(auth.address, "b")


@pytest.mark.timeout(60)
def test_verify_token_reports_reason_instead_of_failing(client: AuthClient) -> None:
    status = client.verify("not-a-token")
    assert status.valid is False
    assert status.reason == "malformed token"
    assert status.username == ""


@pytest.mark.timeout(60)
def test_create_account_without_token_unauthenticated(auth: AuthServerThread, client: AuthClient) -> None:
    with pytest.raises(AuthenticationError, match="missing bearer token"):
        client.create_account("", "bob", USER_PASSWORD)
    with pytest.raises(AuthenticationError, match="malformed token"):
        client.create_account("garbage", "bob", USER_PASSWORD)
    # And at the gRPC level, with no metadata at all:
    with grpc.insecure_channel(auth.address) as channel:
        stub = auth_pb2_grpc.AuthStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.CreateAccount(
                auth_pb2.CreateAccountRequest(username="bob", password=USER_PASSWORD, role="user"), timeout=10
            )
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.timeout(60)
def test_create_account_with_user_token_permission_denied(client: AuthClient) -> None:
    admin_token = client.login("admin", ADMIN_PASSWORD).token
    client.create_account(admin_token, "alice", USER_PASSWORD)
    user_token = client.login("alice", USER_PASSWORD).token
    with pytest.raises(PermissionDeniedError, match="admin of cluster a"):
        client.create_account(user_token, "bob", USER_PASSWORD)


@pytest.mark.timeout(60)
def test_duplicate_account_already_exists(client: AuthClient) -> None:
    admin_token = client.login("admin", ADMIN_PASSWORD).token
    client.create_account(admin_token, "alice", USER_PASSWORD)
    with pytest.raises(AccountExistsError, match="alice"):
        client.create_account(admin_token, "alice", "another-long-password")
    with pytest.raises(AccountExistsError, match="admin"):
        client.create_account(admin_token, "admin", "another-long-password", role="admin")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("username", "password", "role", "field"),
    [
        ("alice", "short", "user", "password"),
        ("alice", "x" * 1025, "user", "password"),
        ("Alice", USER_PASSWORD, "user", "username"),
        ("al", USER_PASSWORD, "user", "username"),
        ("-alice", USER_PASSWORD, "user", "username"),
        ("alice\n", USER_PASSWORD, "user", "username"),
        ("alice", USER_PASSWORD, "root", "role"),
    ],
)
def test_invalid_account_invalid_argument(
    client: AuthClient, username: str, password: str, role: str, field: str
) -> None:
    admin_token = client.login("admin", ADMIN_PASSWORD).token
    with pytest.raises(InvalidRequestError) as info:
        client.create_account(admin_token, username, password, role=role)
    assert str(info.value).startswith(field)


@pytest.mark.timeout(60)
def test_wrong_password_and_unknown_user_indistinguishable(client: AuthClient) -> None:
    failures = _metric("nebula_auth_logins_total", {"outcome": "failure"})
    with pytest.raises(AuthenticationError) as wrong_password:
        client.login("admin", "not-the-admin-password")
    with pytest.raises(AuthenticationError) as unknown_user:
        client.login("nobody", "not-the-admin-password")
    assert str(wrong_password.value) == str(unknown_user.value) == "invalid username or password"
    assert _metric("nebula_auth_logins_total", {"outcome": "failure"}) == failures + 2


@pytest.mark.timeout(60)
def test_password_stored_as_argon2id_hash(client: AuthClient, data_dir: Path) -> None:
    admin_token = client.login("admin", ADMIN_PASSWORD).token
    client.create_account(admin_token, "alice", USER_PASSWORD)
    with sqlite3.connect(data_dir / "accounts.db") as db:
        rows = dict(db.execute("SELECT username, password_hash FROM accounts").fetchall())
    assert set(rows) == {"admin", "alice"}
    for username, password in (("admin", ADMIN_PASSWORD), ("alice", USER_PASSWORD)):
        assert rows[username].startswith("$argon2id$")
        assert password not in rows[username]
    assert rows["admin"] != rows["alice"]


@pytest.mark.timeout(60)
def test_restart_keeps_accounts_and_signing_key(data_dir: Path, password_file: Path) -> None:
    first = AuthServerThread(_settings(data_dir, password_file))
    try:
        with AuthClient(first.address) as sdk:
            admin_token = sdk.login("admin", ADMIN_PASSWORD).token
            sdk.create_account(admin_token, "alice", USER_PASSWORD)
            old_token = sdk.login("alice", USER_PASSWORD).token
        old_keys = TokenVerifier.from_auth_service(first.address, "a").key_ids
    finally:
        first.stop()

    second = AuthServerThread(_settings(data_dir, None))
    try:
        verifier = TokenVerifier.from_auth_service(second.address, "a")
        assert verifier.key_ids == old_keys
        assert verifier.verify(old_token).username == "alice"
        with AuthClient(second.address) as sdk:
            assert sdk.login("alice", USER_PASSWORD).token
            assert sdk.login("admin", ADMIN_PASSWORD).token
            admin_token = sdk.login("admin", ADMIN_PASSWORD).token
            assert sorted(a.username for a in sdk.list_accounts(admin_token)) == ["admin", "alice"]
    finally:
        second.stop()


@pytest.mark.timeout(60)
def test_missing_cluster_id_names_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NEBULA_AUTH_CLUSTER_ID", raising=False)
    monkeypatch.setenv("NEBULA_AUTH_DATA_DIR", str(tmp_path))
    with pytest.raises(ValidationError) as raised:
        AuthSettings()
    assert describe_validation_error(AuthSettings, raised.value) == (
        "NEBULA_AUTH_CLUSTER_ID: required but not set"
    )


@pytest.mark.timeout(60)
def test_health_serving(auth: AuthServerThread) -> None:
    with grpc.insecure_channel(auth.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="nebula.v1.Auth"), timeout=10
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.timeout(60)
def test_metrics_endpoint_exports_auth_counters(data_dir: Path, password_file: Path) -> None:
    settings = _settings(data_dir, password_file).model_copy(update={"metrics_port": 0})
    running = AuthServerThread(settings)
    try:
        port = running.server.metrics_port
        assert port is not None
        assert running.server.ports["metrics"] == port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            body = response.read().decode()
    finally:
        running.stop()
    assert 'nebula_auth_logins_total{outcome="failure"}' in body
    assert "nebula_auth_accounts_created_total" in body
    assert "nebula_auth_tokens_issued_total" in body
