"""Job tokens: scoped to one job, short-lived, renewed at half-life, and refused for anything else."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization

from nebula_common.auth import TokenVerifier
from nebula_common.auth.policy import JOB_METHODS, job_token_may_call
from nebula_common.auth.roles import ROLE_MATRIX
from nebula_common.errors import AuthenticationError
from services.auth.job_tokens import JOB_ID
from services.auth.tokens import TokenIssuer
from services.trainer.job_tokens import TokenTimes

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def issuer(tmp_path: Path) -> TokenIssuer:
    return TokenIssuer(tmp_path / "a", "a", ttl_seconds=600, job_ttl_seconds=120)


@pytest.fixture
def verifier(issuer: TokenIssuer) -> TokenVerifier:
    return TokenVerifier("a", json.dumps(issuer.jwks()))


def test_job_token_names_its_job_and_is_no_account_token(
    issuer: TokenIssuer, verifier: TokenVerifier
) -> None:
    issued = issuer.issue_job("alice", "job-1")
    principal = verifier.verify(issued.token)
    assert (principal.username, principal.role, principal.job_id) == ("alice", "job", "job-1")
    assert issued.expires_at - time.time() == pytest.approx(120, abs=2)
    account = verifier.verify(issuer.issue("alice", "user").token)
    assert account.job_id == ""


def test_job_lifetime_never_exceeds_an_account_token(tmp_path: Path) -> None:
    """Revocations and retired keys are kept one account-token lifetime: a job token must not outlive it."""
    issuer = TokenIssuer(tmp_path / "a", "a", ttl_seconds=60, job_ttl_seconds=900)
    assert issuer.job_ttl_seconds == 60
    with pytest.raises(ValueError, match="positive"):
        TokenIssuer(tmp_path / "b", "a", job_ttl_seconds=0)


def _forge(issuer: TokenIssuer, **claims: Any) -> str:
    """A token signed with the real key but with claims the issuer never writes."""
    key = serialization.load_pem_private_key(issuer.key_path.read_bytes(), password=None)
    now = int(time.time())
    body = {"iss": "nebula-auth/a", "aud": "nebula", "sub": "alice", "cluster": "a", "iat": now, "nbf": now}
    body.update({"exp": now + 60, "jti": "x", **claims})
    return jwt.encode(body, key, algorithm="ES256", headers={"kid": issuer.kid})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "claims",
    [
        {"role": "job"},  # a job role without a job
        {"role": "admin", "job": "job-1"},  # an account role with a job: which is it?
        {"role": "job", "job": 7},
    ],
)
def test_half_job_tokens_are_refused(
    issuer: TokenIssuer, verifier: TokenVerifier, claims: dict[str, Any]
) -> None:
    with pytest.raises(AuthenticationError, match="job token"):
        verifier.verify(_forge(issuer, **claims))


def test_job_token_calls_are_few_and_all_exist() -> None:
    """Only a job's edges, batches and renewal; every one of them a method the role matrix knows."""
    assert set(ROLE_MATRIX) >= JOB_METHODS
    assert job_token_may_call("/nebula.v1.Relay/OpenEdge")
    for method in (
        "/nebula.v1.Trainer/CancelStage",
        "/nebula.v1.Trainer/ListStages",
        "/nebula.v1.Auth/ListAccounts",
        "/nebula.v1.Auth/ChangePassword",
        "/nebula.v1.Data/Grant",
        "/nebula.v1.Data/DownloadDataset",
        "/nebula.v1.AuditLog/Query",
    ):
        assert not job_token_may_call(method), method
    assert ROLE_MATRIX["/nebula.v1.Auth/IssueJobToken"].roles == frozenset({"trainer"})
    assert not ROLE_MATRIX["/nebula.v1.Auth/IssueJobToken"].users


def test_renewal_is_due_at_half_life(issuer: TokenIssuer) -> None:
    issued = issuer.issue_job("alice", "job-1", now=1000.0)
    times = TokenTimes.of(issued.token)
    assert (times.issued_at, times.expires_at) == (1000.0, 1120.0)
    assert not times.due(1059.0)
    assert times.due(1060.0)


@pytest.mark.parametrize("job_id", ["", "a" * 129, "a/b", "a b", "é"])
def test_job_ids_the_auth_service_refuses(job_id: str) -> None:
    assert not JOB_ID.fullmatch(job_id)
