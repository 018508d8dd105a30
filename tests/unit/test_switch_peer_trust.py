"""The switch's peer trust: which CRL it believes, what a stale one does, and what trust removal does.

Real CAs and CRLs from two organisations' separate PKI roots; a third party ("mallory") makes a CA
with the very same name as b's to forge CRLs, and a third organisation c brings a CA without any
name constraint (tests/support/rogue_ca.py).
"""

from __future__ import annotations

import ssl
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from nebula_common.pki import Identity, issue_certificate
from nebula_common.pki.crl import CrlError, build_crl, key_id, load_crl_for
from nebula_common.pki.layout import read_key
from nebula_common.pki.lifecycle import revoke_certificate
from nebula_common.pki.pins import load_pinned, pinned_pem
from nebula_common.pki.store import ClusterPaths, add_trust, init_cluster, remove_trust
from nebula_common.pki.trust import list_trust
from services.switch.peer_trust import PEER_CRL_STALE, PeerTrust
from tests.support.rogue_ca import pem as rogue_pem
from tests.support.rogue_ca import unconstrained_ca

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
    b_ca, b_key = _cert(b.ca_cert), read_key(b.ca_key)
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


def test_an_unconstrained_peer_ca_vouches_for_its_own_cluster_only(
    orgs: tuple[ClusterPaths, ClusterPaths], tmp_path: Path
) -> None:
    """Organisation c brings an enterprise root with no name constraint, named like b's CA: a trusts
    it for c, and it can neither certify b's switch nor sign b's CRL, nor spoil b's genuine CRL."""
    a, b = orgs
    b_ca = _cert(b.ca_cert)
    c_ca, c_key = unconstrained_ca(b_ca.subject)  # a look-alike of b's CA name
    add_trust(a.dir.parent, "a", "c", rogue_pem(c_ca))
    for_b, for_c = _trust(a, tmp_path), PeerTrust("c", a.trust_bundle, cache_path=tmp_path / "crl-c.pem")
    assert for_b.peer_cas == [b_ca] and for_c.peer_cas == [c_ca]

    forged_b, _ = issue_certificate(c_ca, c_key, Identity("b", "switch"))
    found = for_b.check(forged_b)
    assert found is not None and found[0] == "trust" and "for cluster 'b'" in found[1]
    own_c, _ = issue_certificate(c_ca, c_key, Identity("c", "switch"))
    assert for_c.check(own_c) is None
    assert for_b.check(_cert(b.switch_cert)) is None

    with pytest.raises(CrlError, match="not validly signed"):
        for_b.apply(_pem(build_crl(c_ca, c_key, {0xB0B: datetime.now(UTC)}, number=50)), source="link")
    # The loader finds the issuer by key: a same-named CA listed first does not make b's CRL fail.
    genuine = load_crl_for(b.crl.read_bytes(), [c_ca, b_ca], source="b's CRL")
    assert genuine.issuer_key == key_id(b_ca)
    trust_list = {p.peer: p.scope for p in list_trust(a.dir.parent, "a")}
    assert trust_list["c"].startswith("cluster c only (pinned by this cluster; the CA has no name constraint")
    assert trust_list["b"].startswith("cluster b only (pinned, and name-constrained to b.nebula")


def test_a_hand_made_bundle_without_pins_trusts_only_self_constrained_cas(
    orgs: tuple[ClusterPaths, ClusterPaths], tmp_path: Path
) -> None:
    _, b = orgs
    c_ca, _ = unconstrained_ca()
    bundle = tmp_path / "hand-made.pem"
    bundle.write_bytes(b.ca_cert.read_bytes() + rogue_pem(c_ca))  # no Nebula-Peer lines
    for_b = PeerTrust("b", bundle, cache_path=tmp_path / "b.pem")
    for_c = PeerTrust("c", bundle, cache_path=tmp_path / "c.pem")
    assert for_b.peer_cas == [_cert(b.ca_cert)]  # b's CA is constrained to b's domain itself
    assert for_c.peer_cas == [] and "trusts no CA of peer 'c'" in (for_c.closed_reason() or "")


def test_a_crl_number_never_repeats_with_other_contents(
    orgs: tuple[ClusterPaths, ClusterPaths], tmp_path: Path
) -> None:
    a, b = orgs
    b_ca, b_key = _cert(b.ca_cert), read_key(b.ca_key)
    trust = _trust(a, tmp_path)
    five = _pem(build_crl(b_ca, b_key, {0x5: datetime.now(UTC)}, number=5))
    assert trust.apply(five, source="link") is not None
    assert trust.apply(five, source="link") is None  # the same CRL again is no news
    other_five = _pem(build_crl(b_ca, b_key, {}, number=5))
    with pytest.raises(CrlError, match="repeats CRLNumber 5 with other contents"):
        trust.apply(other_five, source="link")
    assert trust.crl_serials == {0x5}


def test_pins_survive_tls_libraries_and_are_read_back(tmp_path: Path) -> None:
    layout_ca, _ = unconstrained_ca()
    bundle = pinned_pem("b", layout_ca) + pinned_pem("c", layout_ca)
    assert [(e.peer, e.cert) for e in load_pinned(bundle)] == [("b", layout_ca), ("c", layout_ca)]
    assert len(x509.load_pem_x509_certificates(bundle)) == 2
    path = tmp_path / "bundle.pem"
    path.write_bytes(bundle)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_verify_locations(cafile=str(path))  # OpenSSL skips the explanatory text
    assert len(context.get_ca_certs()) == 1  # the same CA twice is one root
