"""PKI per organisation: one cluster's CA alone, CA export with a fingerprint, and the trust CLI.

Two organisations here are two separate PKI roots (``org-a``, ``org-b``); the only thing that moves
between them is an exported CA certificate file, as it would by e-mail.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from typer.testing import CliRunner

from nebula_common.cli.pki import app
from nebula_common.pki import ClusterPaths, load_layout
from nebula_common.pki.fingerprint import format_fingerprint, parse_fingerprint
from nebula_common.pki.pins import load_pinned
from nebula_common.pki.store import FingerprintMismatch, PkiError, add_trust, init_cluster, remove_trust
from tests.support.rogue_ca import pem as rogue_pem
from tests.support.rogue_ca import unconstrained_ca

pytestmark = pytest.mark.timeout(60)


def _invoke(*args: str) -> tuple[int, str, str]:
    # Wide enough that rich never wraps a path of pytest's temporary directories inside an error panel.
    result = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "1000"})
    assert "Traceback" not in result.output + result.stderr
    return result.exit_code, result.stdout, result.stderr


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _org(tmp_path: Path, cluster: str) -> tuple[Path, ClusterPaths]:
    root = tmp_path / f"org-{cluster}"
    code, out, err = _invoke("init", "--dir", root, "--cluster", cluster)
    assert code == 0, out + err
    return root, ClusterPaths.for_cluster(root, cluster)


def _export(tmp_path: Path, root: Path, cluster: str) -> tuple[Path, str]:
    out = tmp_path / "mail" / f"{cluster}-ca.crt"
    out.parent.mkdir(exist_ok=True)
    code, stdout, stderr = _invoke("export-ca", "--dir", root, "--cluster", cluster, "--out", out)
    assert code == 0, stdout + stderr
    return out, stdout.strip()


def test_init_one_cluster_creates_only_its_own_ca_and_switch(tmp_path: Path) -> None:
    root, a = _org(tmp_path, "a")
    files = set(_snapshot(root))
    for required in ("a/ca.crt", "a/ca.key", "a/switch.crt", "a/switch.key", "a/crl.pem"):
        assert required in files
    assert not any(name.startswith("a/trust/") for name in files)  # no peer, nothing trusted yet
    assert {p.name for p in root.iterdir()} == {"a", ".pki.lock"}  # no other cluster's directory
    assert (a.ca_key.stat().st_mode & 0o777) == 0o600
    crl = x509.load_pem_x509_crl(a.crl.read_bytes())
    assert crl.is_signature_valid(x509.load_pem_x509_certificate(a.ca_cert.read_bytes()).public_key())
    assert len(list(crl)) == 0

    before = _snapshot(root)
    code, out, _ = _invoke("init", "--dir", root, "--cluster", "a")
    assert code == 0 and "Reusing" in out
    assert _snapshot(root) == before

    a.switch_key.unlink()
    code, _, err = _invoke("init", "--dir", root, "--cluster", "a")
    assert code == 1
    assert "switch.key" in err and "--force" in err


def test_export_ca_prints_the_sha256_fingerprint_of_the_written_file(tmp_path: Path) -> None:
    root, a = _org(tmp_path, "a")
    out, fingerprint = _export(tmp_path, root, "a")
    assert out.read_bytes() == a.ca_cert.read_bytes()
    cert = x509.load_pem_x509_certificate(out.read_bytes())
    assert fingerprint == "SHA256:" + cert.fingerprint(hashes.SHA256()).hex(":").upper()
    assert parse_fingerprint(fingerprint) == cert.fingerprint(hashes.SHA256())
    if shutil.which("openssl"):  # the spelling another organisation's tools print is accepted too
        printed = subprocess.run(
            ["openssl", "x509", "-in", str(out), "-noout", "-fingerprint", "-sha256"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        assert parse_fingerprint(printed) == parse_fingerprint(fingerprint)

    code, _, err = _invoke("export-ca", "--dir", tmp_path / "nowhere", "--cluster", "a", "--out", tmp_path)
    assert code == 1 and "pki init --cluster a" in err


@pytest.mark.parametrize("text", ["", "SHA256:zz", "ab" * 31, "ab" * 33, "MD5:" + "ab" * 32])
def test_bad_fingerprints_are_named(text: str) -> None:
    with pytest.raises(ValueError, match="not a SHA-256 fingerprint"):
        parse_fingerprint(text)


def test_two_organisations_exchange_only_ca_certificates(tmp_path: Path) -> None:
    root_a, a = _org(tmp_path, "a")
    root_b, b = _org(tmp_path, "b")
    a_ca, a_fp = _export(tmp_path, root_a, "a")
    b_ca, b_fp = _export(tmp_path, root_b, "b")
    b_before = _snapshot(root_b)

    # Fingerprints as people paste them: lower case, no colons.
    code, out, err = _invoke(
        "trust", "add", "--dir", root_a, "--cluster", "a", "--peer", "b", "--ca", b_ca,
        "--fingerprint", b_fp.removeprefix("SHA256:").replace(":", "").lower(),
    )  # fmt: skip
    assert code == 0, out + err
    code, out, err = _invoke(
        "trust", "add", "--dir", root_b, "--cluster", "b", "--peer", "a", "--ca", a_ca, "--fingerprint", a_fp
    )
    assert code == 0, out + err

    # Each side now loads as a complete one-cluster PKI trusting exactly the other's CA.
    assert load_layout(root_a, ["a"]).cluster("a").trust_cert("b").read_bytes() == b.ca_cert.read_bytes()
    assert load_layout(root_b, ["b"]).cluster("b").trust_cert("a").read_bytes() == a.ca_cert.read_bytes()
    bundle = x509.load_pem_x509_certificates(a.trust_bundle.read_bytes())
    assert [format_fingerprint(c) for c in bundle] == [b_fp]
    # No private key crossed: org-a holds no byte of b's keys and vice versa.
    for key in (b.ca_key, b.switch_key):
        assert all(key.read_bytes() not in data for data in _snapshot(root_a).values())
    b_after = _snapshot(root_b)
    changed = {name for name in b_after if b_before.get(name) != b_after[name]}
    assert changed - {"b/audit/audit.log", "b/audit/audit.log.seal"} == {
        "b/trust/a.crt",
        "b/trust-bundle.pem",
    }

    code, out, _ = _invoke("trust", "list", "--dir", root_a, "--cluster", "a", "--json")
    assert code == 0
    listed = json.loads(out)
    assert [(p["peer"], p["fingerprint"]) for p in listed] == [("b", b_fp)]

    # The audit log of a's PKI names what was trusted.
    records = [json.loads(line) for line in (a.audit_dir / "audit.log").read_text().splitlines()]
    added = [r for r in records if r["event"] == "trust.add"]
    assert added and added[-1]["details"]["peer"] == "b" and added[-1]["details"]["fingerprint"] == b_fp


def test_a_wrong_fingerprint_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    root_a, _ = _org(tmp_path, "a")
    root_b, _ = _org(tmp_path, "b")
    root_m, _ = _org(tmp_path / "mallory", "b")  # someone else's CA, also calling itself b
    b_ca, b_fp = _export(tmp_path, root_b, "b")
    forged, _ = _export(tmp_path / "mallory", root_m, "b")
    before = _snapshot(root_a)

    code, _, err = _invoke(
        "trust",
        "add",
        "--dir",
        root_a,
        "--cluster",
        "a",
        "--peer",
        "b",
        "--ca",
        forged,
        "--fingerprint",
        b_fp,
    )
    assert code == 2
    assert "fingerprint mismatch for peer 'b'" in err and "Nothing was written" in err
    assert b_fp in err  # what you were told, next to what the file has
    assert _snapshot(root_a) == before

    with pytest.raises(FingerprintMismatch):
        add_trust(root_a, "a", "b", forged.read_bytes(), expected_fingerprint=parse_fingerprint(b_fp))
    assert _snapshot(root_a) == before

    code, _, err = _invoke(
        "trust",
        "add",
        "--dir",
        root_a,
        "--cluster",
        "a",
        "--peer",
        "b",
        "--ca",
        b_ca,
        "--fingerprint",
        "1234",
    )
    assert code == 2 and "not a SHA-256 fingerprint" in err
    code, _, err = _invoke(
        "trust", "add", "--dir", root_a, "--cluster", "a", "--peer", "b",
        "--ca", tmp_path / "missing.crt", "--fingerprint", b_fp,
    )  # fmt: skip
    assert code == 2 and "missing.crt" in err
    assert _snapshot(root_a) == before


def test_trust_add_refuses_a_ca_for_another_cluster_and_the_own_ca(tmp_path: Path) -> None:
    root_a, a = _org(tmp_path, "a")
    root_b, _ = _org(tmp_path, "b")
    b_ca, b_fp = _export(tmp_path, root_b, "b")
    a_ca, a_fp = _export(tmp_path, root_a, "a")
    code, _, err = _invoke(
        "trust", "add", "--dir", root_a, "--cluster", "a", "--peer", "c", "--ca", b_ca, "--fingerprint", b_fp
    )
    assert code == 1 and "may only certify b.nebula.internal" in err
    code, _, err = _invoke(
        "trust", "add", "--dir", root_a, "--cluster", "a", "--peer", "x", "--ca", a_ca, "--fingerprint", a_fp
    )
    assert code == 1 and "own CA" in err
    assert not any(a.trust_dir.iterdir())


def _a_trusting_b_and_c(tmp_path: Path) -> tuple[Path, ClusterPaths, dict[str, Path]]:
    """Organisation a's PKI trusting the CAs of organisations b and c (their PKI roots returned too)."""
    root_a, a = _org(tmp_path, "a")
    roots = {}
    for peer in ("b", "c"):
        roots[peer], _ = _org(tmp_path, peer)
        ca, fp = _export(tmp_path, roots[peer], peer)
        add_trust(root_a, "a", peer, ca.read_bytes(), expected_fingerprint=parse_fingerprint(fp))
    return root_a, a, roots


def test_trust_remove_drops_the_ca_its_crl_and_rebuilds_the_bundle(tmp_path: Path) -> None:
    root_a, a, roots = _a_trusting_b_and_c(tmp_path)
    for peer, root in roots.items():  # the switch keeps a CRL copy next to the CA when one comes by file
        shutil.copy(root / peer / "crl.pem", a.trust_crl(peer))

    code, out, err = _invoke("trust", "list", "--dir", root_a, "--cluster", "a")
    assert code == 0 and out.splitlines()[0].startswith("b  SHA256:") and "CRL #1" in out

    code, out, err = _invoke("trust", "remove", "--dir", root_a, "--cluster", "a", "--peer", "b")
    assert code == 0, out + err
    assert not a.trust_cert("b").exists() and not a.trust_crl("b").exists()
    bundle = x509.load_pem_x509_certificates(a.trust_bundle.read_bytes())
    assert [c.subject.rfc4514_string() for c in bundle] == ["O=Nebula,CN=Nebula cluster c CA"]
    records = [json.loads(line) for line in (a.audit_dir / "audit.log").read_text().splitlines()]
    assert [r["details"]["peer"] for r in records if r["event"] == "trust.remove"] == ["b"]

    code, _, err = _invoke("trust", "remove", "--dir", root_a, "--cluster", "a", "--peer", "b")
    assert code == 1 and "does not trust peer 'b'" in err
    with pytest.raises(PkiError, match="does not trust"):
        remove_trust(root_a, "a", "b")


def test_force_keeps_trusted_peers_and_issues_a_new_ca(tmp_path: Path) -> None:
    root_a, a = _org(tmp_path, "a")
    root_b, _ = _org(tmp_path, "b")
    b_ca, b_fp = _export(tmp_path, root_b, "b")
    add_trust(root_a, "a", "b", b_ca.read_bytes(), expected_fingerprint=parse_fingerprint(b_fp))
    old_ca = a.ca_cert.read_bytes()
    paths, created = init_cluster(root_a, "a", force=True)
    assert created and paths == a
    assert a.ca_cert.read_bytes() != old_ca
    assert a.trust_cert("b").read_bytes() == b_ca.read_bytes()
    load_layout(root_a, ["a"])


def test_init_flags_are_exclusive(tmp_path: Path) -> None:
    for args in ([], ["--cluster", "a", "--clusters", "a,b"], ["--cluster", "A"]):
        code, _, err = _invoke("init", "--dir", tmp_path, *args)
        assert code == 2, err


def test_trust_list_names_an_unreadable_peer_crl_instead_of_showing_none(tmp_path: Path) -> None:
    """A broken CRL copy next to a peer CA is an operator's problem to see, not "no CRL"."""
    root_a, a, _ = _a_trusting_b_and_c(tmp_path)
    a.trust_crl("b").write_bytes(b"-----BEGIN X509 CRL-----\ntruncated\n")  # not a CRL at all
    shutil.copy(tmp_path / "org-b" / "b" / "crl.pem", a.trust_crl("c"))  # a CRL, but by b's CA

    code, out, err = _invoke("trust", "list", "--dir", root_a, "--cluster", "a")
    assert code == 0, out + err
    lines = dict(line.split("  ", 1) for line in out.splitlines())
    assert "unreadable CRL: " in lines["b"] and "is not a PEM CRL" in lines["b"], lines["b"]
    assert "unreadable CRL: " in lines["c"] and "not a trusted CA" in lines["c"], lines["c"]
    assert "no CRL" not in out

    code, out, _ = _invoke("trust", "list", "--dir", root_a, "--cluster", "a", "--json")
    assert code == 0
    listed = {p["peer"]: p for p in json.loads(out)}
    assert listed["b"]["crl_number"] is None and "is not a PEM CRL" in listed["b"]["crl_error"]
    assert "not a trusted CA" in listed["c"]["crl_error"]

    shutil.copy(tmp_path / "org-c" / "c" / "crl.pem", a.trust_crl("c"))  # the right one: no error
    code, out, _ = _invoke("trust", "list", "--dir", root_a, "--cluster", "a", "--json")
    listed = {p["peer"]: p for p in json.loads(out)}
    assert listed["c"]["crl_error"] is None and listed["c"]["crl_number"] == 1


def test_a_fingerprint_is_printed_to_the_letter_even_where_it_spells_an_emoji_code(tmp_path: Path) -> None:
    """Rich turns ``:ab:`` into an emoji by default; a fingerprint with an ``AB`` byte must survive it."""
    root_a, _ = _org(tmp_path, "a")
    root_b, _ = _org(tmp_path, "b")
    b_ca, _ = _export(tmp_path, root_b, "b")
    told = "SHA256:" + ":".join(["AB"] * 32)  # wrong on purpose, and full of ":AB:"
    code, _, err = _invoke(
        "trust", "add", "--dir", root_a, "--cluster", "a", "--peer", "b", "--ca", b_ca, "--fingerprint", told
    )
    assert code == 2 and told in err, err


def test_a_ca_without_name_constraint_is_pinned_to_its_peer_and_listed_so(tmp_path: Path) -> None:
    root_a, a = _org(tmp_path, "a")
    root_b, _ = _org(tmp_path, "b")
    b_ca, b_fp = _export(tmp_path, root_b, "b")
    enterprise, _ = unconstrained_ca()
    c_ca = tmp_path / "c-ca.crt"
    c_ca.write_bytes(rogue_pem(enterprise))
    c_fp = format_fingerprint(enterprise)
    for peer, ca, fp in (("b", b_ca, b_fp), ("c", c_ca, c_fp)):
        code, out, err = _invoke(
            "trust", "add", "--dir", root_a, "--cluster", "a", "--peer", peer, "--ca", ca, "--fingerprint", fp
        )
        assert code == 0, out + err
    assert "may certify cluster c only (pinned by this cluster; the CA has no name constraint)" in out

    bundle = a.trust_bundle.read_bytes()
    assert [(e.peer, format_fingerprint(e.cert)) for e in load_pinned(bundle)] == [("b", b_fp), ("c", c_fp)]
    code, out, _ = _invoke("trust", "list", "--dir", root_a, "--cluster", "a")
    assert code == 0
    assert "may certify: cluster b only (pinned, and name-constrained to b.nebula.internal)" in out
    assert "may certify: cluster c only (pinned by this cluster" in out
    code, out, _ = _invoke("trust", "list", "--dir", root_a, "--cluster", "a", "--json")
    assert [p["scope"].split(" (")[0] for p in json.loads(out)] == ["cluster b only", "cluster c only"]
