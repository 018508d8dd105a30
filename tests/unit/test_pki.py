"""Tests of the dev PKI: certificate contents, identities, the on-disk layout, and the CLI."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TypeVar

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from typer.testing import CliRunner

from nebula_common.cli.pki import app
from nebula_common.pki import (
    ClusterPaths,
    Identity,
    PkiError,
    PkiLayout,
    add_trust,
    create_ca,
    identity_from_certificate,
    identity_from_pem,
    init_pki,
    issue_certificate,
    load_layout,
    validate_cluster_id,
)

pytestmark = pytest.mark.timeout(60)

A_SWITCH = Identity("a", "switch")


_E = TypeVar("_E", bound=x509.ExtensionType)


def _ext(cert: x509.Certificate, kind: type[_E]) -> x509.Extension[_E]:
    return cert.extensions.get_extension_for_class(kind)


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _fp(cert: x509.Certificate) -> bytes:
    return cert.fingerprint(hashes.SHA256())


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --------------------------------------------------------------------------------------------------
# Identity


def test_identity_names() -> None:
    assert A_SWITCH.uri == "spiffe://nebula/cluster/a/switch"
    assert A_SWITCH.dns_name == "switch.a.nebula.internal"
    assert Identity.from_uri(A_SWITCH.uri) == A_SWITCH
    long_id = "x" + "-9" * 15
    assert Identity.from_uri(Identity(long_id, "switch").uri).cluster_id == long_id


@pytest.mark.parametrize(
    "uri",
    [
        "spiffe://nebula/cluster/a/switch/",
        "spiffe://nebula/cluster/a/switch?x=1",
        "spiffe://other/cluster/a/switch",
        "https://nebula/cluster/a/switch",
        "spiffe://nebula/cluster/A/switch",
        "spiffe://nebula/cluster/a/operatorx",
        "spiffe://nebula/cluster/../switch",
        "spiffe://nebula/cluster//switch",
        "spiffe://nebula/cluster/a",
        "",
    ],
)
def test_identity_from_bad_uri_names_it(uri: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        Identity.from_uri(uri)
    assert repr(uri) in str(excinfo.value)


@pytest.mark.parametrize("cluster_id", ["", "A", "1a", "-a", "a_b", "a.b", "a/b", "a" * 32, "é"])
def test_invalid_cluster_ids_are_rejected(cluster_id: str) -> None:
    with pytest.raises(ValueError, match="invalid cluster id"):
        validate_cluster_id(cluster_id)
    with pytest.raises(ValueError):
        Identity(cluster_id, "switch")


def test_unknown_role_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown role"):
        Identity("a", "root")


def test_identity_round_trips_through_certificate_and_pem() -> None:
    ca_cert, ca_key = create_ca("a")
    leaf, _ = issue_certificate(ca_cert, ca_key, A_SWITCH)
    assert identity_from_certificate(leaf) == A_SWITCH
    assert identity_from_pem(leaf.public_bytes(serialization.Encoding.PEM)) == A_SWITCH


def _custom_leaf(names: list[x509.GeneralName] | None) -> x509.Certificate:
    """A leaf with arbitrary SANs, for the malformed-identity cases issue_certificate can't produce."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "odd")]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "odd")]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + timedelta(days=1))
    )
    if names is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(key, hashes.SHA256())


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (None, "no subjectAltName"),
        ([x509.DNSName(A_SWITCH.dns_name)], "no URI SAN"),
        (
            [
                x509.UniformResourceIdentifier(A_SWITCH.uri),
                x509.UniformResourceIdentifier("spiffe://nebula/cluster/b/switch"),
                x509.DNSName(A_SWITCH.dns_name),
            ],
            "ambiguous",
        ),
        (
            [x509.UniformResourceIdentifier(A_SWITCH.uri), x509.DNSName("switch.b.nebula.internal")],
            "matching DNS SAN",
        ),
        ([x509.UniformResourceIdentifier("spiffe://nebula/cluster/a/")], "invalid Nebula identity URI"),
    ],
)
def test_identity_from_malformed_certificate(names: list[x509.GeneralName] | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        identity_from_certificate(_custom_leaf(names))


def test_identity_from_pem_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="not a PEM"):
        identity_from_pem(b"hello")


# --------------------------------------------------------------------------------------------------
# CA and leaf contents


def test_ca_certificate_contents() -> None:
    cert, key = create_ca("a")
    assert isinstance(key.curve, ec.SECP256R1)
    assert cert.public_key() == key.public_key()
    assert cert.subject == cert.issuer
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "Nebula cluster a CA"
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "Nebula"
    cert.verify_directly_issued_by(cert)

    bc = _ext(cert, x509.BasicConstraints)
    assert bc.critical and bc.value.ca and bc.value.path_length == 0
    ku = _ext(cert, x509.KeyUsage)
    assert ku.critical and ku.value.key_cert_sign and ku.value.crl_sign
    assert not ku.value.digital_signature
    ski = _ext(cert, x509.SubjectKeyIdentifier)
    assert ski.value == x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    nc = _ext(cert, x509.NameConstraints)
    assert nc.critical and nc.value.permitted_subtrees == [x509.DNSName("a.nebula.internal")]

    assert cert.not_valid_after_utc - cert.not_valid_before_utc >= timedelta(days=3650)
    short, _ = create_ca("a", validity=timedelta(days=2))
    assert short.not_valid_after_utc - datetime.now(UTC) < timedelta(days=2, minutes=1)


def test_leaf_certificate_contents() -> None:
    ca_cert, ca_key = create_ca("a")
    before = datetime.now(UTC).replace(microsecond=0)
    leaf, key = issue_certificate(ca_cert, ca_key, A_SWITCH)
    after = datetime.now(UTC)

    assert isinstance(key.curve, ec.SECP256R1)
    assert leaf.public_key() == key.public_key()
    assert leaf.issuer == ca_cert.subject
    leaf.verify_directly_issued_by(ca_cert)

    bc = _ext(leaf, x509.BasicConstraints)
    assert bc.critical and not bc.value.ca
    ku = _ext(leaf, x509.KeyUsage)
    assert ku.critical and ku.value.digital_signature
    assert not ku.value.key_cert_sign and not ku.value.crl_sign
    eku = _ext(leaf, x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    san = _ext(leaf, x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [A_SWITCH.uri]
    assert san.get_values_for_type(x509.DNSName) == [A_SWITCH.dns_name]
    aki = _ext(leaf, x509.AuthorityKeyIdentifier).value
    assert aki.key_identifier == _ext(ca_cert, x509.SubjectKeyIdentifier).value.digest
    assert _ext(leaf, x509.SubjectKeyIdentifier).value == x509.SubjectKeyIdentifier.from_public_key(
        key.public_key()
    )

    # Backdated five minutes for clock skew; valid for seven days from now.
    assert before - timedelta(minutes=5, seconds=1) <= leaf.not_valid_before_utc
    assert leaf.not_valid_before_utc <= after - timedelta(minutes=5)
    assert before + timedelta(days=7) <= leaf.not_valid_after_utc <= after + timedelta(days=7)

    other, _ = issue_certificate(ca_cert, ca_key, A_SWITCH)
    assert other.serial_number != leaf.serial_number


def test_leaf_with_explicit_window_and_key() -> None:
    ca_cert, ca_key = create_ca("a")
    key = ec.generate_private_key(ec.SECP256R1())
    start = datetime(2020, 1, 1, tzinfo=UTC)
    leaf, returned = issue_certificate(
        ca_cert, ca_key, A_SWITCH, not_before=start, validity=timedelta(hours=1), key=key
    )
    assert returned is key
    assert leaf.not_valid_before_utc == start
    assert leaf.not_valid_after_utc == start + timedelta(hours=1)


def test_issue_certificate_rejects_bad_inputs() -> None:
    ca_cert, ca_key = create_ca("a")
    other_ca, other_key = create_ca("b")
    leaf, leaf_key = issue_certificate(ca_cert, ca_key, A_SWITCH)
    with pytest.raises(ValueError, match="does not belong"):
        issue_certificate(ca_cert, other_key, A_SWITCH)
    with pytest.raises(ValueError, match="not a CA"):
        issue_certificate(leaf, leaf_key, A_SWITCH)
    with pytest.raises(ValueError, match="P-256"):
        issue_certificate(ca_cert, ca_key, A_SWITCH, key=ec.generate_private_key(ec.SECP384R1()))
    with pytest.raises(ValueError, match="positive"):
        issue_certificate(ca_cert, ca_key, A_SWITCH, validity=timedelta(0))
    with pytest.raises(ValueError, match="timezone-aware"):
        issue_certificate(ca_cert, ca_key, A_SWITCH, not_before=datetime(2030, 1, 1))
    with pytest.raises(ValueError, match="outlive"):
        issue_certificate(ca_cert, ca_key, A_SWITCH, validity=timedelta(days=4000))
    assert other_ca is not None


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl binary not installed")
def test_openssl_agrees_on_purpose_and_name_constraints(tmp_path: Path) -> None:
    """An independent verifier accepts the leaf for both TLS roles and enforces the name constraint."""
    ca_cert, ca_key = create_ca("a")
    good, _ = issue_certificate(ca_cert, ca_key, A_SWITCH)
    rogue, _ = issue_certificate(ca_cert, ca_key, Identity("b", "switch"))
    for name, cert in (("ca", ca_cert), ("good", good), ("rogue", rogue)):
        (tmp_path / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def verify(name: str, purpose: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                "openssl",
                "verify",
                "-CAfile",
                str(tmp_path / "ca.pem"),
                "-purpose",
                purpose,
                str(tmp_path / name),
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    for purpose in ("sslserver", "sslclient"):
        result = verify("good.pem", purpose)
        assert result.returncode == 0, result.stdout + result.stderr
    result = verify("rogue.pem", "sslclient")
    assert result.returncode != 0
    assert "permitted subtree violation" in result.stdout + result.stderr


# --------------------------------------------------------------------------------------------------
# Layout on disk


def _all_files(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_init_pki_layout_permissions_and_trust(tmp_path: Path) -> None:
    layout = init_pki(tmp_path, ["a", "b"], leaf_validity=timedelta(hours=3))
    assert isinstance(layout, PkiLayout)
    assert layout.created
    assert layout.root == tmp_path
    a, b = layout.cluster("a"), layout.cluster("b")
    assert a == ClusterPaths.for_cluster(tmp_path, "a")
    assert a.ca_cert == tmp_path / "a" / "ca.crt"
    assert a.trust_bundle == tmp_path / "a" / "trust-bundle.pem"

    expected = {
        f"{c}/{name}"
        for c, peer in (("a", "b"), ("b", "a"))
        for name in (
            "ca.crt",
            "ca.key",
            "switch.crt",
            "switch.key",
            f"trust/{peer}.crt",
            "trust-bundle.pem",
            "crl.pem",  # this CA's (empty) revocation list ...
            f"trust/{peer}.crl.pem",  # ... and the peer's, which this cluster's switch loads
            "audit/audit.log",  # CA operations (the switch certificate's issue)
            "audit/audit.log.seal",
            "audit/audit-key.pem",
            "audit/audit-key.pub.pem",
        )
    }
    expected.add(".pki.lock")  # serialises concurrent writers of this root
    assert {str(p.relative_to(tmp_path)) for p in _all_files(tmp_path)} == expected  # no temp files left

    for paths in (a, b):
        assert _mode(paths.ca_key) == 0o600
        assert _mode(paths.switch_key) == 0o600
        assert _mode(paths.ca_cert) == 0o644
        ca = _cert(paths.ca_cert)
        leaf = _cert(paths.switch_cert)
        leaf.verify_directly_issued_by(ca)
        assert identity_from_certificate(leaf) == paths.switch_identity
        key = serialization.load_pem_private_key(paths.switch_key.read_bytes(), password=None)
        assert key.public_key() == leaf.public_key()
        assert b"BEGIN PRIVATE KEY" in paths.ca_key.read_bytes()  # PKCS#8, unencrypted
        assert leaf.not_valid_after_utc - datetime.now(UTC) <= timedelta(hours=3)

    # a trusts b's CA, and not its own; and vice versa.
    assert a.trust_cert("b").read_bytes() == b.ca_cert.read_bytes()
    a_bundle = {_fp(c) for c in x509.load_pem_x509_certificates(a.trust_bundle.read_bytes())}
    assert a_bundle == {_fp(_cert(b.ca_cert))}
    b_bundle = {_fp(c) for c in x509.load_pem_x509_certificates(b.trust_bundle.read_bytes())}
    assert b_bundle == {_fp(_cert(a.ca_cert))}
    assert not a.trust_cert("a").exists()


def test_concurrent_inits_produce_one_consistent_layout(tmp_path: Path) -> None:
    with ThreadPoolExecutor(max_workers=4) as pool:
        layouts = list(pool.map(lambda _: init_pki(tmp_path, ["a", "b"]), range(4)))
    assert sum(layout.created for layout in layouts) == 1
    load_layout(tmp_path, ["a", "b"])


def test_three_clusters_trust_every_other(tmp_path: Path) -> None:
    layout = init_pki(tmp_path, ["a", "b", "c"])
    for cid in ("a", "b", "c"):
        paths = layout.cluster(cid)
        peers = {p.stem for p in paths.trust_dir.glob("*.crt")}
        assert peers == {"a", "b", "c"} - {cid}
        assert len(x509.load_pem_x509_certificates(paths.trust_bundle.read_bytes())) == 2
    with pytest.raises(PkiError, match="not part of"):
        layout.cluster("d")


def test_keys_are_never_readable_by_others_even_with_permissive_umask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, int] = {}
    real_replace: Callable[[str | Path, str | Path], None] = os.replace

    def spying_replace(src: str | Path, dst: str | Path) -> None:
        # Record the temp file's mode at the last moment before it becomes visible under its name.
        seen[Path(dst).name + "@" + Path(dst).parent.name] = stat.S_IMODE(os.stat(src).st_mode)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spying_replace)
    old_umask = os.umask(0)
    try:
        layout = init_pki(tmp_path, ["a", "b"])
    finally:
        os.umask(old_umask)
    assert seen["ca.key@a"] == seen["switch.key@b"] == 0o600
    assert seen["ca.crt@a"] == 0o644
    for cid in ("a", "b"):
        assert _mode(layout.cluster(cid).ca_key) == 0o600
        assert _mode(layout.cluster(cid).switch_key) == 0o600


def test_second_init_reuses_existing_layout(tmp_path: Path) -> None:
    init_pki(tmp_path, ["a", "b"])
    before = _all_files(tmp_path)
    again = init_pki(tmp_path, ["a", "b"])
    assert not again.created
    assert _all_files(tmp_path) == before
    assert load_layout(tmp_path, ["a", "b"]).cluster("a").switch_cert.exists()
    assert load_layout(tmp_path, ["b"]).cluster("b").trust_cert("a").exists()  # one cluster alone


@pytest.mark.parametrize("missing", ["a/switch.key", "b/trust/a.crt", "a/trust-bundle.pem", "b/ca.crt"])
def test_init_refuses_partial_layout(tmp_path: Path, missing: str) -> None:
    init_pki(tmp_path, ["a", "b"])
    (tmp_path / missing).unlink()
    before = _all_files(tmp_path)
    with pytest.raises(PkiError) as excinfo:
        init_pki(tmp_path, ["a", "b"])
    message = str(excinfo.value)
    assert str(tmp_path / missing) in message
    assert "force" in message
    assert _all_files(tmp_path) == before  # nothing overwritten


def test_init_refuses_inconsistent_layout(tmp_path: Path) -> None:
    init_pki(tmp_path, ["a", "b"])
    # b's switch certificate copied over a's: present, parseable, but wrong.
    shutil.copy(tmp_path / "b" / "switch.crt", tmp_path / "a" / "switch.crt")
    with pytest.raises(PkiError, match="was not issued by"):
        init_pki(tmp_path, ["a", "b"])
    with pytest.raises(PkiError, match="was not issued by"):
        load_layout(tmp_path, ["a"])


def test_init_refuses_stale_bundle(tmp_path: Path) -> None:
    init_pki(tmp_path, ["a", "b"])
    (tmp_path / "a" / "trust-bundle.pem").write_bytes((tmp_path / "b" / "switch.crt").read_bytes())
    with pytest.raises(PkiError, match="stale"):
        load_layout(tmp_path, ["a", "b"])


def test_init_refuses_to_reuse_expired_switch_certificate(tmp_path: Path) -> None:
    layout = init_pki(tmp_path, ["a", "b"])
    a = layout.cluster("a")
    ca_key = serialization.load_pem_private_key(a.ca_key.read_bytes(), password=None)
    leaf_key = serialization.load_pem_private_key(a.switch_key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey) and isinstance(leaf_key, ec.EllipticCurvePrivateKey)
    expired, _ = issue_certificate(
        _cert(a.ca_cert),
        ca_key,
        A_SWITCH,
        key=leaf_key,
        not_before=datetime.now(UTC) - timedelta(days=2),
        validity=timedelta(days=1),
    )
    a.switch_cert.write_bytes(expired.public_bytes(serialization.Encoding.PEM))
    load_layout(tmp_path, ["a", "b"])  # still loadable, e.g. to show it
    with pytest.raises(PkiError, match="expired"):
        init_pki(tmp_path, ["a", "b"])


def test_force_regenerates_everything(tmp_path: Path) -> None:
    first = init_pki(tmp_path, ["a", "b"])
    old_ca = _fp(_cert(first.cluster("a").ca_cert))
    (tmp_path / "a" / "switch.key").unlink()
    second = init_pki(tmp_path, ["a", "b"], force=True)
    assert second.created
    a, b = second.cluster("a"), second.cluster("b")
    assert _fp(_cert(a.ca_cert)) != old_ca
    assert b.trust_cert("a").read_bytes() == a.ca_cert.read_bytes()
    assert _mode(a.switch_key) == 0o600
    load_layout(tmp_path, ["a", "b"])


@pytest.mark.parametrize(
    ("clusters", "message"),
    [
        (["a"], "at least 2"),
        (["a", "a"], "duplicate"),
        (["a", "B"], "invalid cluster id"),
        (["a", "../x"], "invalid"),
    ],
)
def test_init_validates_cluster_ids(tmp_path: Path, clusters: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        init_pki(tmp_path, clusters)
    assert not any(tmp_path.iterdir())


def test_load_layout_of_missing_root(tmp_path: Path) -> None:
    with pytest.raises(PkiError, match="missing"):
        load_layout(tmp_path / "nowhere", ["a", "b"])


# --------------------------------------------------------------------------------------------------
# Manual trust exchange


def test_add_trust_accepts_another_organisations_ca(tmp_path: Path) -> None:
    layout = init_pki(tmp_path, ["a", "b"])
    d_ca, _ = create_ca("d")
    written = add_trust(tmp_path, "a", "d", d_ca.public_bytes(serialization.Encoding.PEM))
    a = layout.cluster("a")
    assert written == a.trust_cert("d")
    bundle = {_fp(c) for c in x509.load_pem_x509_certificates(a.trust_bundle.read_bytes())}
    assert bundle == {_fp(d_ca), _fp(_cert(layout.cluster("b").ca_cert))}
    assert not init_pki(tmp_path, ["a", "b"]).created  # still a complete, consistent layout
    assert not list(a.trust_dir.glob(".*"))


def test_add_trust_rejects_leaf_and_other_bad_input(tmp_path: Path) -> None:
    layout = init_pki(tmp_path, ["a", "b"])
    a = layout.cluster("a")
    bundle_before = a.trust_bundle.read_bytes()
    leaf_pem = layout.cluster("b").switch_cert.read_bytes()
    with pytest.raises(PkiError, match="not a CA certificate"):
        add_trust(tmp_path, "a", "b", leaf_pem)
    with pytest.raises(PkiError, match="own CA"):
        add_trust(tmp_path, "a", "d", a.ca_cert.read_bytes())
    with pytest.raises(PkiError, match="own CA"):
        add_trust(tmp_path, "a", "a", layout.cluster("b").ca_cert.read_bytes())
    with pytest.raises(PkiError, match="exactly one"):
        add_trust(tmp_path, "a", "d", layout.cluster("b").ca_cert.read_bytes() * 2)
    with pytest.raises(PkiError, match="not PEM"):
        add_trust(tmp_path, "a", "d", b"not a certificate")
    with pytest.raises(PkiError, match="run init first"):
        add_trust(tmp_path, "zz", "d", layout.cluster("b").ca_cert.read_bytes())
    assert a.trust_bundle.read_bytes() == bundle_before
    assert a.trust_cert("b").read_bytes() == layout.cluster("b").ca_cert.read_bytes()


# --------------------------------------------------------------------------------------------------
# CLI


def test_cli_init_then_reuse_then_force(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(
        app, ["init", "--dir", str(tmp_path), "--clusters", "a,b", "--leaf-validity-hours", "2"]
    )
    assert result.exit_code == 0, result.output
    assert "spiffe://nebula/cluster/a/switch" in result.output
    assert "spiffe://nebula/cluster/b/switch" in result.output
    assert str(tmp_path / "a" / "switch.key") in result.output
    assert str(tmp_path / "b" / "trust" / "a.crt") in result.output
    leaf = _cert(tmp_path / "a" / "switch.crt")
    assert leaf.not_valid_after_utc - datetime.now(UTC) <= timedelta(hours=2)
    ca_before = (tmp_path / "a" / "ca.crt").read_bytes()

    result = runner.invoke(app, ["init", "--dir", str(tmp_path), "--clusters", "a,b"])
    assert result.exit_code == 0, result.output
    assert "Reusing" in result.output
    assert (tmp_path / "a" / "ca.crt").read_bytes() == ca_before

    (tmp_path / "b" / "ca.key").unlink()
    result = runner.invoke(app, ["init", "--dir", str(tmp_path), "--clusters", "a,b"])
    assert result.exit_code == 1
    assert "error:" in result.output and str(tmp_path / "b" / "ca.key") in result.output
    assert "Traceback" not in result.output

    result = runner.invoke(app, ["init", "--dir", str(tmp_path), "--clusters", "a,b", "--force"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "a" / "ca.crt").read_bytes() != ca_before
    assert (tmp_path / "b" / "ca.key").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["--clusters", "a"],
        ["--clusters", "a,a"],
        ["--clusters", "a,B"],
        ["--clusters", "a,b", "--leaf-validity-hours", "0"],
        ["--clusters", "a,b", "--leaf-validity-hours", "x"],
    ],
)
def test_cli_init_bad_arguments_exit_2(tmp_path: Path, args: list[str]) -> None:
    result = CliRunner().invoke(app, ["init", "--dir", str(tmp_path), *args])
    assert result.exit_code == 2, result.output
    assert not any(tmp_path.iterdir())


def test_cli_show(tmp_path: Path) -> None:
    init_pki(tmp_path, ["a", "b"])
    runner = CliRunner()
    result = runner.invoke(app, ["show", "--dir", str(tmp_path), "--cluster", "a"])
    assert result.exit_code == 0, result.output
    leaf = _cert(tmp_path / "a" / "switch.crt")
    ca = _cert(tmp_path / "a" / "ca.crt")
    peer_ca = _cert(tmp_path / "b" / "ca.crt")
    out = result.output
    assert "CN=switch.a.nebula.internal" in out
    assert "CN=Nebula cluster a CA" in out and "CN=Nebula cluster b CA" in out
    assert "URI:spiffe://nebula/cluster/a/switch" in out and "DNS:switch.a.nebula.internal" in out
    for cert in (leaf, ca, peer_ca):
        assert f"{cert.serial_number:x}" in out
        assert cert.not_valid_after_utc.isoformat() in out
        assert cert.not_valid_before_utc.isoformat() in out

    result = runner.invoke(app, ["show", "--dir", str(tmp_path), "--cluster", "zz"])
    assert result.exit_code == 1
    assert "no PKI for cluster 'zz'" in result.output
    result = runner.invoke(app, ["show", "--dir", str(tmp_path), "--cluster", "Not-Valid"])
    assert result.exit_code == 2


def test_cli_without_arguments_shows_help() -> None:
    result = CliRunner().invoke(app, [])
    assert "init" in result.output and "show" in result.output
