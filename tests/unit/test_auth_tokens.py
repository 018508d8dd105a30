"""Token issuing and local verification: what the switch and trainer rely on to refuse foreign tokens."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import stat
import time
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization

from nebula_common.auth import Principal, TokenVerifier
from nebula_common.errors import AuthenticationError
from services.auth.tokens import KEY_FILE_NAME, TokenIssuer


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _claims(cluster: str = "a", **overrides: Any) -> dict[str, Any]:
    now = int(time.time())
    claims: dict[str, Any] = {
        "iss": f"nebula-auth/{cluster}",
        "aud": "nebula",
        "sub": "alice",
        "role": "admin",
        "cluster": cluster,
        "iat": now,
        "nbf": now,
        "exp": now + 600,
        "jti": "test-jti",
    }
    claims.update(overrides)
    return claims


def _sign_with_issuer_key(issuer: TokenIssuer, claims: dict[str, Any]) -> str:
    key = serialization.load_pem_private_key(issuer.key_path.read_bytes(), password=None)
    return jwt.encode(claims, key, algorithm="ES256", headers={"kid": issuer.kid})


@pytest.fixture
def issuer(tmp_path: Path) -> TokenIssuer:
    return TokenIssuer(tmp_path / "a", "a", ttl_seconds=600)


@pytest.fixture
def verifier(issuer: TokenIssuer) -> TokenVerifier:
    return TokenVerifier("a", json.dumps(issuer.jwks()))


@pytest.mark.timeout(60)
def test_round_trip(issuer: TokenIssuer, verifier: TokenVerifier) -> None:
    issued = issuer.issue("alice", "user")
    assert verifier.verify(issued.token) == Principal(username="alice", role="user", cluster_id="a")
    header = jwt.get_unverified_header(issued.token)
    assert header["alg"] == "ES256"
    assert header["kid"] == issuer.kid
    claims = jwt.decode(issued.token, options={"verify_signature": False})
    assert claims["iss"] == "nebula-auth/a"
    assert claims["aud"] == "nebula"
    assert claims["cluster"] == "a"
    assert claims["exp"] - claims["iat"] == 600
    assert claims["exp"] == issued.expires_at
    assert claims["jti"] == issued.jti
    assert issuer.issue("alice", "user").jti != issued.jti


@pytest.mark.timeout(60)
def test_jwks_holds_only_the_public_key(issuer: TokenIssuer) -> None:
    (key,) = issuer.jwks()["keys"]
    assert key["kty"] == "EC"
    assert key["crv"] == "P-256"
    assert key["kid"] == issuer.kid
    assert key["alg"] == "ES256"
    assert "d" not in key
    assert len(issuer.kid) == 16


@pytest.mark.timeout(60)
def test_expired_token_rejected(issuer: TokenIssuer, verifier: TokenVerifier) -> None:
    issued = issuer.issue("alice", "user", now=time.time() - 3600)
    with pytest.raises(AuthenticationError, match="token expired"):
        verifier.verify(issued.token)


@pytest.mark.timeout(60)
def test_clock_skew_within_leeway_accepted(issuer: TokenIssuer, verifier: TokenVerifier) -> None:
    just_expired = issuer.issue("alice", "user", now=time.time() - 600 - 10)
    assert verifier.verify(just_expired.token).username == "alice"
    from_the_future = issuer.issue("alice", "user", now=time.time() + 10)
    assert verifier.verify(from_the_future.token).username == "alice"
    far_future = issuer.issue("alice", "user", now=time.time() + 300)
    with pytest.raises(AuthenticationError, match="not yet valid"):
        verifier.verify(far_future.token)


@pytest.mark.timeout(60)
def test_token_of_other_cluster_rejected(tmp_path: Path, verifier: TokenVerifier) -> None:
    issuer_b = TokenIssuer(tmp_path / "b", "b")
    token_b = issuer_b.issue("mallory", "admin").token
    with pytest.raises(AuthenticationError, match="token issued by cluster b, expected a"):
        verifier.verify(token_b)
    # Even given b's keys, a verifier for cluster a refuses b's tokens.
    confused = TokenVerifier("a", json.dumps(issuer_b.jwks()))
    with pytest.raises(AuthenticationError, match="token issued by cluster b, expected a"):
        confused.verify(token_b)


@pytest.mark.timeout(60)
def test_wrong_audience_rejected(issuer: TokenIssuer, verifier: TokenVerifier) -> None:
    token = _sign_with_issuer_key(issuer, _claims(aud="someone-else"))
    with pytest.raises(AuthenticationError, match="audience"):
        verifier.verify(token)


@pytest.mark.timeout(60)
def test_missing_claim_rejected(issuer: TokenIssuer, verifier: TokenVerifier) -> None:
    claims = _claims()
    del claims["role"]
    with pytest.raises(AuthenticationError, match="role"):
        verifier.verify(_sign_with_issuer_key(issuer, claims))


@pytest.mark.timeout(60)
def test_cluster_claim_must_match_issuer(issuer: TokenIssuer, verifier: TokenVerifier) -> None:
    token = _sign_with_issuer_key(issuer, _claims(cluster="b", iss="nebula-auth/a"))
    with pytest.raises(AuthenticationError, match="cluster claim"):
        verifier.verify(token)


@pytest.mark.timeout(60)
def test_tampered_payload_rejected(issuer: TokenIssuer, verifier: TokenVerifier) -> None:
    header, _payload, signature = issuer.issue("alice", "user").token.split(".")
    forged_payload = _b64(json.dumps(_claims(role="admin")).encode())
    with pytest.raises(AuthenticationError, match="invalid token signature"):
        verifier.verify(f"{header}.{forged_payload}.{signature}")


@pytest.mark.timeout(60)
def test_unknown_kid_rejected(tmp_path: Path, verifier: TokenVerifier) -> None:
    # Same cluster name, different key: e.g. an auth service whose data dir was wiped.
    other = TokenIssuer(tmp_path / "a-other", "a")
    with pytest.raises(AuthenticationError, match=f"unknown signing key id '{other.kid}'"):
        verifier.verify(other.issue("alice", "admin").token)


@pytest.mark.timeout(60)
def test_alg_none_forgery_rejected(issuer: TokenIssuer, verifier: TokenVerifier) -> None:
    header = _b64(json.dumps({"alg": "none", "typ": "JWT", "kid": issuer.kid}).encode())
    payload = _b64(json.dumps(_claims()).encode())
    for token in (f"{header}.{payload}.", f"{header}.{payload}"):
        with pytest.raises(AuthenticationError):
            verifier.verify(token)


@pytest.mark.timeout(60)
def test_hs256_with_public_key_forgery_rejected(issuer: TokenIssuer, verifier: TokenVerifier) -> None:
    """The classic key-confusion attack: HMAC-sign with the published public key as secret."""
    header = _b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": issuer.kid}).encode())
    payload = _b64(json.dumps(_claims()).encode())
    public_pem = (
        serialization.load_pem_private_key(issuer.key_path.read_bytes(), password=None)
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    jwk_secret = json.dumps(issuer.jwks()["keys"][0]).encode()
    for secret in (public_pem, jwk_secret):
        signature = _b64(hmac.new(secret, f"{header}.{payload}".encode(), hashlib.sha256).digest())
        with pytest.raises(AuthenticationError, match="HS256"):
            verifier.verify(f"{header}.{payload}.{signature}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("token", ["", "garbage", "a.b.c", "...."])
def test_malformed_token_rejected(verifier: TokenVerifier, token: str) -> None:
    with pytest.raises(AuthenticationError, match="malformed token"):
        verifier.verify(token)


@pytest.mark.timeout(60)
def test_key_persisted_and_reloaded(tmp_path: Path) -> None:
    first = TokenIssuer(tmp_path / "data", "a")
    token = first.issue("alice", "user").token
    second = TokenIssuer(tmp_path / "data", "a")
    assert second.kid == first.kid
    assert second.jwks() == first.jwks()
    assert second.verifier().verify(token).username == "alice"
    assert [p.name for p in (tmp_path / "data").iterdir()] == [KEY_FILE_NAME]


@pytest.mark.timeout(60)
def test_key_file_mode_0600(issuer: TokenIssuer) -> None:
    assert stat.S_IMODE(issuer.key_path.stat().st_mode) == 0o600
    assert b"BEGIN PRIVATE KEY" in issuer.key_path.read_bytes()  # PKCS8


@pytest.mark.timeout(60)
def test_jwks_with_private_material_refused(issuer: TokenIssuer) -> None:
    key = serialization.load_pem_private_key(issuer.key_path.read_bytes(), password=None)
    private_jwk = jwt.algorithms.ECAlgorithm.to_jwk(key, as_dict=True)
    private_jwk["kid"] = issuer.kid
    with pytest.raises(ValueError, match="private key material"):
        TokenVerifier("a", json.dumps({"keys": [private_jwk]}))
