"""The switch's peer trust: which CRL it believes, what a stale one does, and what trust removal does.

Real CAs and CRLs from two organisations' separate PKI roots; a third party ("mallory") makes a CA
with the very same name as b's to forge CRLs.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from nebula_common.pki.crl import CrlError, build_crl
from nebula_common.pki.store import (
    ClusterPaths,
    _read_key,
    add_trust,
    init_cluster,
    remove_trust,
    revoke_certificate,
)
from services.switch.peer_trust import PEER_CRL_STALE, PeerTrust

pytestmark = pytest.mark.timeout(60)


def _org(tmp_path: Path, name: str, cluster: str) -> ClusterPaths:
    paths, _ = init_cluster(tmp_path / name, cluster)
    return paths


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _pem(crl: x509.CertificateRevocationList) -> bytes:
    return crl.public_bytes(serialization.Encoding.PEM)


@pytest.fixture
def orgs(tmp_path: Path) -> tuple[ClusterPaths, ClusterPaths]:
    a, b = _org(tmp_path, "org-a", "a"), _org(tmp_path, "org-b", "b")
    add_trust(a.dir.parent, "a", "b", b.ca_cert.read_bytes())
    return a, b


def _trust(
    a: ClusterPaths, tmp_path: Path, *, fail_closed: bool = False, data: str = "switch-a"
) -> PeerTrust:
    return PeerTrust(
        "b", a.trust_bundle, cache_path=tmp_path / data / "peer-crl.pem", fail_closed=fail_closed
    )


def test_a_crl_signed_by_the_pinned_ca_is_applied_kept_and_enforced(
    orgs: tuple[ClusterPaths, ClusterPaths], tmp_path: Path
) -> None:
    a, b = orgs
    trust = _trust(a, tmp_path)
    assert trust.loaded is None and trust.closed_reason() is None  # fail-open until the first CRL
    b_switch = _cert(b.switch_cert)
    assert not trust.is_revoked(b_switch)

    assert trust.apply(b.crl.read_bytes(), source="link") is not None
    assert trust.apply(b.crl.read_bytes(), source="link") is None  # the same CRL again: nothing new
    revoke_certificate(b.dir.parent, "b", b_switch.serial_number)
    loaded = trust.apply(b.crl.read_bytes(), source="link")
    assert loaded is not None and loaded.number == 2
    assert trust.is_revoked(b_switch) and b_switch.serial_number in trust.revoked

    # A restarted switch enforces the kept CRL before the peer is reachable.
    again = _trust(a, tmp_path)
    assert again.loaded is not None and again.loaded.number == 2 and again.is_revoked(b_switch)


def test_forged_and_replayed_crls_are_refused(
    orgs: tuple[ClusterPaths, ClusterPaths], tmp_path: Path
) -> None:
    a, b = orgs
    mallory = _org(tmp_path, "org-m", "b")  # another CA calling itself "Nebula cluster b CA"
    trust = _trust(a, tmp_path)
    with pytest.raises(CrlError, match="not validly signed"):
        trust.apply(mallory.crl.read_bytes(), source="link")
    with pytest.raises(CrlError, match="not a PEM CRL"):
        trust.apply(b"garbage", source="link")
    own = _org(tmp_path, "org-c", "c")
    with pytest.raises(CrlError, match="not a trusted CA"):
        trust.apply(own.crl.read_bytes(), source="link")

    b_switch = _cert(b.switch_cert)
    first = b.crl.read_bytes()
    revoke_certificate(b.dir.parent, "b", b_switch.serial_number)
    trust.apply(b.crl.read_bytes(), source="link")
    with pytest.raises(CrlError, match="older than the 2 in force"):
        trust.apply(first, source="replay")  # replaying CRL #1 must not un-revoke b's switch
    assert trust.is_revoked(b_switch)


def test_a_stale_crl_is_an_alarm_and_fails_closed_only_by_setting(
    orgs: tuple[ClusterPaths, ClusterPaths], tmp_path: Path
) -> None:
    a, b = orgs
    b_ca, b_key = _cert(b.ca_cert), _read_key(b.ca_key)
    short = _pem(build_crl(b_ca, b_key, {}, number=5, validity=timedelta(minutes=10)))
    later = datetime.now(UTC) + timedelta(hours=1)
    b_switch = _cert(b.switch_cert)

    open_trust = _trust(a, tmp_path)
    open_trust.apply(short, source="link")
    events = open_trust.refresh(now=later)
    assert [name for name, _ in events] == ["crl.stale"] and events[0][1]["fail_closed"] is False
    assert PEER_CRL_STALE.labels("b")._value.get() == 1  # the alarm metric, per peer
    assert open_trust.refresh(now=later) == []  # alarmed once, not on every poll
    assert open_trust.closed_reason(now=later) is None  # still enforced, link stays up

    closed = _trust(a, tmp_path, fail_closed=True, data="switch-a2")  # nothing kept from before
    assert "no CRL of peer 'b' received yet" in (closed.closed_reason() or "")
    assert closed.is_revoked(b_switch)
    closed.apply(short, source="link")
    assert closed.closed_reason() is None
    assert "past nextUpdate" in (closed.closed_reason(now=later) or "")
    fresh = _pem(build_crl(b_ca, b_key, {}, number=6))
    closed.apply(fresh, source="link")
    assert closed.closed_reason(now=later) is None


def test_removed_trust_closes_the_gate_and_an_unknown_issuer_is_refused(
    orgs: tuple[ClusterPaths, ClusterPaths], tmp_path: Path
) -> None:
    a, b = orgs
    trust = _trust(a, tmp_path)
    b_switch = _cert(b.switch_cert)
    mallory = _org(tmp_path, "org-m", "b")
    assert not trust.is_revoked(b_switch)
    assert trust.refusal(_cert(mallory.switch_cert)) is not None  # same name, other CA

    remove_trust(a.dir.parent, "a", "b")
    events = trust.refresh()
    assert ("trust.reload", {"trusted_peer_cas": 0}) in events
    assert "trust removed" in (trust.closed_reason() or "")
    assert b_switch.serial_number in trust.revoked and trust.is_revoked(b_switch)
