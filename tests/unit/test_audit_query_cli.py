"""``nebula audit query`` against a real switch's AuditLog API: filters, JSON lines, admin only."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from typer.testing import CliRunner

from nebula_common.cli.app import app
from nebula_common.pki import PkiLayout
from nebula_common.sdk.auth_client import AuthClient
from tests.support.accounts import ADMIN_PASSWORD, auth_settings
from tests.support.servers import accepting_switch, running_auth

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, pki_ab: PkiLayout) -> Iterator[tuple[str, str, str]]:
    """A running auth + switch of cluster b; yields (switch internal address, admin token, user token)."""
    work = tmp_path_factory.mktemp("audit-cli")
    with (
        running_auth(auth_settings(work, "b")) as auth,
        accepting_switch(work, pki_ab.cluster("b"), "a", auth.address) as switch,
        AuthClient(auth.address) as client,
    ):
        admin = client.login("admin", ADMIN_PASSWORD).token
        client.create_account(admin, "uma-user", "uma-has-a-long-password")
        user = client.login("uma-user", "uma-has-a-long-password").token
        yield switch.internal_address, admin, user


def _query(address: str, token: str, *args: str) -> tuple[int, list[dict[str, object]], str]:
    result = CliRunner().invoke(app, ["audit", "query", "--switch", address, "--token", token, *args])
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    return result.exit_code, lines, result.output


def test_query_prints_matching_records_as_json_lines(cluster: tuple[str, str, str]) -> None:
    address, admin, _ = cluster
    code, records, output = _query(address, admin, "--event", "switch.start")
    assert code == 0, output
    assert [r["event"] for r in records] == ["switch.start"]
    assert records[0]["service"] == "switch" and records[0]["cluster"] == "b"

    # Each query is itself audited, under the admin's name; --account/--since/--limit narrow it.
    since = (datetime.now(UTC) - timedelta(minutes=5)).isoformat()
    code, records, output = _query(
        address, admin, "--event", "audit.", "--account", "admin", "--since", since, "--limit", "1"
    )
    assert code == 0, output
    assert len(records) == 1 and records[0]["account"] == "admin", records
    assert str(records[0]["event"]).startswith("audit.")
    code, records, output = _query(
        address, admin, "--event", "switch.start", "--until", "2000-01-01T00:00:00Z"
    )
    assert code == 0 and records == [], output


def test_query_is_refused_without_an_admin_token(cluster: tuple[str, str, str]) -> None:
    address, _, user = cluster
    code, records, output = _query(address, user)
    assert code == 1 and records == [], output
    assert "PERMISSION_DENIED" in output
    code, _, output = _query(address, "not-a-token")
    assert code == 1 and "UNAUTHENTICATED" in output, output
    code, _, output = _query(address, user, "--since", "yesterday")
    assert code == 2 and "ISO 8601" in output, output
