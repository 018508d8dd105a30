"""Account lifecycle, lockout and signing-key rotation on a real auth server, each step audited."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nebula_common.audit import SealVerifier, verify_log
from nebula_common.auth import KeySnapshot, TokenVerifier
from nebula_common.errors import AuthenticationError, InvalidRequestError, PermissionDeniedError
from nebula_common.sdk.auth_client import AuthClient
from tests.support.accounts import ADMIN_PASSWORD, auth_settings
from tests.support.servers import AuthServerThread, running_auth

pytestmark = pytest.mark.timeout(60)
ALICE_PASSWORD = "alice-has-a-long-password"


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "auth"


@pytest.fixture
def auth(tmp_path: Path, data_dir: Path) -> Iterator[AuthServerThread]:
    settings = auth_settings(
        tmp_path, "a", data_dir=data_dir, max_failed_logins=3, lockout_seconds=2, token_ttl_seconds=600
    )
    with running_auth(settings) as running:
        yield running


@pytest.fixture
def client(auth: AuthServerThread) -> Iterator[AuthClient]:
    with AuthClient(auth.address) as sdk:
        yield sdk


def _events(data_dir: Path) -> list[tuple[str, str, str]]:
    lines = (data_dir / "audit.log").read_text().splitlines()
    return [
        (r["event"], r["outcome"], r["details"].get("target", r["account"]))
        for r in map(json.loads, lines)
        if r["event"] not in ("audit.open", "audit.seal")
    ]


def test_account_lifecycle_is_enforced_and_audited(
    client: AuthClient, auth: AuthServerThread, data_dir: Path
) -> None:
    admin = client.login("admin", ADMIN_PASSWORD).token
    client.create_account(admin, "alice", ALICE_PASSWORD)
    alice = client.login("alice", ALICE_PASSWORD).token

    assert [a.username for a in client.list_accounts(admin)] == ["admin", "alice"]
    with pytest.raises(PermissionDeniedError):
        client.list_accounts(alice)

    # Own password: needs the current one; another account's: looks like it does not exist.
    with pytest.raises(PermissionDeniedError, match="current password"):
        client.change_password(alice, "alice", "a-brand-new-password", current_password="wrong-password!")
    client.change_password(alice, "alice", "a-brand-new-password", current_password=ALICE_PASSWORD)
    # The new password ends every token issued with the old one, the caller's own included.
    with pytest.raises(AuthenticationError, match="token revoked: password changed"):
        client.list_accounts(alice)
    alice = client.login("alice", "a-brand-new-password").token
    with pytest.raises(InvalidRequestError, match="no account 'admin'"):
        client.change_password(alice, "admin", "taking-over-the-admin")
    with pytest.raises(InvalidRequestError, match="at least 12"):
        client.change_password(admin, "alice", "short")
    with pytest.raises(AuthenticationError):
        client.login("alice", ALICE_PASSWORD)
    alice = client.login("alice", "a-brand-new-password").token

    info = client.disable_account(admin, "alice")
    assert info.disabled
    with pytest.raises(AuthenticationError):
        client.login("alice", "a-brand-new-password")
    with pytest.raises(AuthenticationError, match="disabled"):  # her old token no longer works on auth
        client.change_password(
            alice, "alice", "yet-another-password", current_password="a-brand-new-password"
        )
    assert not client.enable_account(admin, "alice").disabled
    client.login("alice", "a-brand-new-password")

    with pytest.raises(InvalidRequestError, match="last enabled admin"):
        client.disable_account(admin, "admin")
    with pytest.raises(InvalidRequestError, match="last enabled admin"):
        client.delete_account(admin, "admin")
    client.delete_account(admin, "alice")
    with pytest.raises(AuthenticationError):
        client.login("alice", "a-brand-new-password")
    with pytest.raises(InvalidRequestError, match="no account 'alice'"):
        client.enable_account(admin, "alice")

    events = _events(data_dir)
    for expected in [
        ("account.create", "ok", "alice"),
        ("account.password", "failure", "alice"),
        ("account.password", "ok", "alice"),
        ("account.disable", "ok", "alice"),
        ("login", "failure", "alice"),
        ("account.enable", "ok", "alice"),
        ("account.delete", "ok", "alice"),
    ]:
        assert expected in events, (expected, events)
    # The live log (partly sealed; the fixture's stop seals the rest) is intact.
    result = verify_log(
        data_dir / "audit.log",
        SealVerifier.from_file(data_dir / "audit-key.pub.pem"),
        require_seal_file=False,
    )
    assert result.ok, result


def test_repeated_failures_lock_the_account_for_a_while(client: AuthClient, data_dir: Path) -> None:
    admin = client.login("admin", ADMIN_PASSWORD).token
    client.create_account(admin, "bob-user", ALICE_PASSWORD)
    for _ in range(3):
        with pytest.raises(AuthenticationError):
            client.login("bob-user", "not-bobs-password")
    locked = next(a for a in client.list_accounts(admin) if a.username == "bob-user")
    assert locked.locked_until > time.time()
    with pytest.raises(AuthenticationError, match="invalid username or password"):  # even the right one
        client.login("bob-user", ALICE_PASSWORD)
    assert ("account.lock", "refused", "bob-user") in _events(data_dir)
    time.sleep(2.2)
    client.login("bob-user", ALICE_PASSWORD)  # the lock expired; success resets the counter
    assert next(a for a in client.list_accounts(admin) if a.username == "bob-user").locked_until == 0


def test_signing_key_rotation_keeps_old_tokens_and_verifiers_refetch_once(
    client: AuthClient, auth: AuthServerThread, data_dir: Path
) -> None:
    admin = client.login("admin", ADMIN_PASSWORD).token
    fetches: list[float] = []
    real = TokenVerifier._refresher(auth.address, "a")

    def counting() -> KeySnapshot:
        fetches.append(time.monotonic())
        return real()

    verifier = TokenVerifier("a", real().jwks_json, refresh=counting, refresh_interval_s=30.0)
    old_kid, new_kid = client.rotate_signing_key(admin)
    assert old_kid != new_kid
    assert verifier.verify(admin).username == "admin"  # old token, old key: still published
    fresh = client.login("admin", ADMIN_PASSWORD).token
    assert verifier.verify(fresh).username == "admin"  # unknown kid -> one refetch -> accepted
    assert len(fetches) == 1 and new_kid in verifier.key_ids and old_kid in verifier.key_ids

    # Forged kids cannot make the verifier hammer the auth service: at most one fetch per interval.
    forged: Callable[[str], str] = lambda kid: fresh.replace(fresh.split(".")[0], _header(kid))  # noqa: E731
    for i in range(20):
        with pytest.raises(AuthenticationError, match="unknown signing key id"):
            verifier.verify(forged(f"bogus{i}"))
    assert len(fetches) == 1
    assert ("token.key_rotate", "ok", "admin") in _events(data_dir)
    client.create_account(admin, "carol-user", ALICE_PASSWORD)
    carol = client.login("carol-user", ALICE_PASSWORD).token
    with pytest.raises(PermissionDeniedError):
        client.rotate_signing_key(carol)


def _header(kid: str) -> str:
    import base64

    raw = json.dumps({"alg": "ES256", "kid": kid, "typ": "JWT"}).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def test_revocations_reach_remote_verifiers_within_seconds(
    client: AuthClient, auth: AuthServerThread
) -> None:
    """Disable/delete/password change end old tokens at a remote verifier via its background poll."""
    admin = client.login("admin", ADMIN_PASSWORD).token
    client.create_account(admin, "dave-user", ALICE_PASSWORD)
    dave = client.login("dave-user", ALICE_PASSWORD).token
    verifier = TokenVerifier.from_auth_service(auth.address, "a")
    try:
        assert verifier.verify(dave).username == "dave-user"
        epoch = verifier.revocation_epoch
        client.disable_account(admin, "dave-user")
        started = time.monotonic()
        while True:
            try:
                verifier.verify(dave)
            except AuthenticationError as exc:
                assert str(exc) == "token revoked: account disabled"
                break
            assert time.monotonic() - started < 5.0, "disabled account's token still accepted after 5 s"
            time.sleep(0.05)
        assert verifier.revocation_epoch == epoch + 1
        client.enable_account(admin, "dave-user")
        fresh = client.login("dave-user", ALICE_PASSWORD).token  # issued after the revocation
        assert verifier.verify(fresh).username == "dave-user"
        with pytest.raises(AuthenticationError, match="account disabled"):
            verifier.verify(dave)  # re-enabling does not resurrect tokens from before the disable

        # An older snapshot (stale reply, rolled-back auth database) must not un-revoke anything.
        stale = KeySnapshot(TokenVerifier._refresher(auth.address, "a")().jwks_json, revocation_epoch=0)
        with pytest.raises(ValueError, match="epoch went back"):
            verifier.apply(stale)
        with pytest.raises(AuthenticationError, match="account disabled"):
            verifier.verify(dave)

        client.delete_account(admin, "dave-user")
        verifier.refresh_now()
        with pytest.raises(AuthenticationError, match="token revoked: account deleted"):
            verifier.verify(fresh)
    finally:
        verifier.close()
