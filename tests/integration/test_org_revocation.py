"""Two organisations, two PKI roots, two real switches: revocation and offboarding travel over the link.

The organisations share nothing but the CA certificates they exchanged through ``nebula pki
export-ca`` / ``trust add`` (with the fingerprint check). No CRL file is ever copied: each switch
sends its own CA's CRL to the peer over the WAN port (nebula.v1.SwitchTrust).

* revoking b's switch certificate on b's side only makes a close the live link and refuse b within
  10 s, with an audit record on both sides;
* ``nebula pki trust remove`` on a's side closes a's link to b within seconds;
* only the peer switch's identity may use the CRL exchange (an operator certificate is refused);
* with fail-closed, a refuses b until b's CRL reaches it over the link.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from typer.testing import CliRunner

from nebula_common.cli.pki import app as pki_app
from nebula_common.pki import ClusterPaths, Identity, channel_credentials_from_files, channel_options
from nebula_common.pki.lifecycle import issue_leaf
from nebula_common.pki.store import init_cluster
from nebula_common.proto.nebula.v1 import trust_pb2_grpc
from services.switch.config import SwitchSettings
from tests.support.accounts import auth_settings
from tests.support.servers import SwitchThread, running_auth
from tests.support.waiting import wait_for as wait_with_deadline

wait_for = functools.partial(wait_with_deadline, interval=0.05)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _records(path: Path, event: str) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r["event"] == event]


def _cli(*args: object) -> str:
    result = CliRunner().invoke(pki_app, [str(a) for a in args])
    assert result.exit_code == 0, result.output + result.stderr
    return result.stdout


@dataclass
class Org:
    cluster: str
    root: Path
    paths: ClusterPaths


def _organisations(tmp_path: Path) -> dict[str, Org]:
    """Each organisation initialises its own PKI; they swap CA files and check fingerprints."""
    orgs = {}
    for cluster in ("a", "b"):
        root = tmp_path / f"org-{cluster}" / "pki"
        paths, _ = init_cluster(root, cluster)
        orgs[cluster] = Org(cluster, root, paths)
    mail = tmp_path / "mail"
    mail.mkdir()
    for cluster, peer in (("a", "b"), ("b", "a")):
        fingerprint = _cli("export-ca", "--dir", orgs[peer].root, "--cluster", peer, "--out", mail).strip()
        _cli(
            "trust", "add", "--dir", orgs[cluster].root, "--cluster", cluster, "--peer", peer,
            "--ca", mail / f"{peer}-ca.crt", "--fingerprint", fingerprint,
        )  # fmt: skip
    return orgs


@dataclass
class Pair:
    a: SwitchThread
    b: SwitchThread

    def audit(self, switch: SwitchThread, event: str) -> list[dict[str, Any]]:
        return _records(Path(switch.running.audit.path), event)


@contextmanager
def organisation_switches(
    tmp_path: Path, orgs: dict[str, Org], *, wait_link: bool = True, **per_cluster: dict[str, Any]
) -> Iterator[Pair]:
    """b accepts, a dials b's WAN port; each reads only its own organisation's directory.

    ``per_cluster`` (``a={...}``, ``b={...}``) overrides settings of one switch.
    """

    def settings(cluster: str, peer: str, auth: str, **extra: Any) -> SwitchSettings:
        paths = orgs[cluster].paths
        fields: dict[str, Any] = {
            "cluster_id": cluster,
            "peer_cluster_id": peer,
            "tls_cert": paths.switch_cert,
            "tls_key": paths.switch_key,
            "trust_bundle": paths.trust_bundle,
            "own_crl": paths.crl,
            "auth_address": auth,
            "data_dir": tmp_path / f"org-{cluster}" / "switch",
            "metrics_port": -1,
        }
        return SwitchSettings(**(fields | extra | per_cluster.get(cluster, {})))

    with ExitStack() as stack:
        auth = {
            c: stack.enter_context(running_auth(auth_settings(tmp_path / f"org-{c}", c))) for c in ("a", "b")
        }
        b = SwitchThread(settings("b", "a", auth["b"].address, link_role="accept"))
        stack.callback(b.stop)
        a = SwitchThread(
            settings(
                "a", "b", auth["a"].address, link_role="dial", peer_address=f"127.0.0.1:{b.running.wan_port}"
            )
        )
        stack.callback(a.stop)
        if wait_link:
            wait_for(lambda: a.running.link.connected and b.running.link.connected, 30, "the link to come up")
        yield Pair(a, b)


def test_revoking_b_on_b_side_only_makes_a_refuse_b_within_10_s(tmp_path: Path) -> None:
    orgs = _organisations(tmp_path)
    with organisation_switches(tmp_path, orgs) as pair:
        # Each side received the other's CRL #1 over the link, not from a file.
        wait_for(lambda: pair.a.running.revocation.loaded is not None, 10, "a to receive b's CRL")
        wait_for(lambda: pair.b.running.revocation.loaded is not None, 10, "b to receive a's CRL")
        assert pair.a.running.revocation.loaded.number == 1
        assert not orgs["a"].paths.trust_crl("b").exists()  # no file was copied into a's PKI
        b_serial = x509.load_pem_x509_certificate(orgs["b"].paths.switch_cert.read_bytes()).serial_number

        started = time.monotonic()
        _cli("revoke", "--dir", orgs["b"].root, "--cluster", "b", "--cert", orgs["b"].paths.switch_cert)
        wait_for(lambda: not pair.a.running.link.connected, 10, "a to close the link to the revoked b")
        closed_after = time.monotonic() - started

        applied = wait_for(
            lambda: [r for r in pair.audit(pair.a, "crl.apply") if r["details"]["crl_number"] == 2],
            5,
            "a's audit record of b's CRL #2",
        )
        assert applied[0]["details"]["source"] == "link" and applied[0]["details"]["revoked"] == 1
        refused = wait_for(
            lambda: [r for r in pair.audit(pair.a, "link.refused") if r["details"]["layer"] == "revoked"],
            5,
            "a's refusal of the revoked b",
        )
        assert any(r["details"].get("serial") == f"{b_serial:x}" for r in refused)
        # b's side: the CA operation in b's PKI audit, and b's switch sending CRL #2 to a.
        revoked = _records(orgs["b"].paths.audit_dir / "audit.log", "cert.revoke")
        assert [r["details"]["serial"] for r in revoked] == [f"{b_serial:x}"]
        assert any(r["details"]["crl_number"] == 2 for r in pair.audit(pair.b, "crl.send"))
        # It stays refused: a keeps redialling, and refuses b's revoked certificate each time.
        time.sleep(1.0)
        assert not pair.a.running.link.connected
        # The CRL a holds survives a restart (kept in a's switch data directory, not in b's files).
        assert (tmp_path / "org-a" / "switch" / "peer-crl.pem").read_bytes() == orgs[
            "b"
        ].paths.crl.read_bytes()
        print(f"revoked on b's side only; a closed the link after {closed_after:.2f}s")


def test_trust_remove_closes_the_live_link_within_seconds(tmp_path: Path) -> None:
    orgs = _organisations(tmp_path)
    with organisation_switches(tmp_path, orgs) as pair:
        # Only the peer *switch* may exchange CRLs: an operator certificate of a (valid TLS) is refused.
        cert, key = issue_leaf(orgs["a"].root, "a", "operator", tmp_path / "operator")
        credentials = channel_credentials_from_files(cert, key, orgs["a"].paths.trust_bundle)
        address = f"127.0.0.1:{pair.b.running.wan_port}"
        with grpc.secure_channel(
            address, credentials, options=channel_options(Identity("b", "switch"))
        ) as ch:
            call = trust_pb2_grpc.SwitchTrustStub(ch).ExchangeCrl(iter([]), timeout=10)
            with pytest.raises(grpc.RpcError) as refused:
                list(call)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert any(
            r["details"].get("rpc") == "ExchangeCrl" and "operator" in r["details"]["reason"]
            for r in pair.audit(pair.b, "link.refused")
        )

        started = time.monotonic()
        _cli("trust", "remove", "--dir", orgs["a"].root, "--cluster", "a", "--peer", "b")
        wait_for(lambda: not pair.a.running.link.connected, 10, "a to close the link to the removed peer")
        closed_after = time.monotonic() - started
        closed = wait_for(
            lambda: pair.audit(pair.a, "trust.closed"), 5, "a's audit record of the closed link"
        )
        assert "trust removed" in closed[0]["details"]["reason"]
        time.sleep(1.0)
        assert not pair.a.running.link.connected
        print(f"trust removed on a's side; a closed the link after {closed_after:.2f}s")


def test_fail_closed_refuses_the_peer_until_its_crl_arrives(tmp_path: Path) -> None:
    """With NEBULA_SWITCH_CRL_FAIL_CLOSED, a refuses b while it holds no CRL of b's CA, and lets b in
    within seconds of b's switch publishing one (b's own file; nothing is copied to a)."""
    orgs = _organisations(tmp_path)
    published = tmp_path / "org-b" / "published-crl.pem"  # b publishes its CRL here only later
    with organisation_switches(
        tmp_path, orgs, wait_link=False, a={"crl_fail_closed": True}, b={"own_crl": published}
    ) as pair:
        refused = wait_for(
            lambda: [r for r in pair.audit(pair.a, "link.refused") if r["details"]["layer"] == "revoked"],
            15,
            "a to refuse b while it has no CRL of b",
        )
        assert refused
        assert "no CRL of peer 'b' received yet" in (pair.a.running.revocation.closed_reason() or "")
        assert not pair.a.running.link.connected
        started = time.monotonic()
        published.write_bytes(orgs["b"].paths.crl.read_bytes())
        # The CRL arrives within a second; the link follows at a's next dial (its retry backoff is <= 5 s).
        wait_for(lambda: pair.a.running.link.connected, 30, "the link once b's CRL reached a")
        print(f"fail-closed: link up {time.monotonic() - started:.2f}s after b published its CRL")
        assert any(r["details"]["source"] == "link" for r in pair.audit(pair.a, "crl.apply"))
