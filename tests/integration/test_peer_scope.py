"""A peer CA vouches only for its own cluster: three organisations on real switches.

Switch b links to a and to c. Organisation c brings an enterprise root without any name constraint,
named exactly like a's CA, and b trusts it for c. c then mints ``spiffe://nebula/cluster/a/switch``
and tries to be a on b's WAN port: over the gRPC link, over the records link, and on the CRL exchange;
and, as itself, sends b a CRL in a's name revoking a's switch. Every attempt is refused and audited
(layer ``trust``), the genuine a-b link stays up in the same session, and b's list for a is untouched.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from nebula_common.pki import Identity, PkiLayout, add_trust, channel_options, init_pki, issue_certificate
from nebula_common.pki.crl import build_crl
from nebula_common.proto.nebula.v1 import link_pb2, link_pb2_grpc, trust_pb2, trust_pb2_grpc
from nebula_common.rpc.exporter_tls import openssl_context
from services.switch.link_handshake import PROTOCOL_VERSION, HandshakeError
from services.switch.rawlink_connection import RawConnection
from services.switch.rawlink_dialer import dial_raw
from tests.support.accounts import auth_settings
from tests.support.rogue_ca import pem, unconstrained_ca
from tests.support.servers import SwitchThread, running_auth
from tests.support.switch_mesh import chain_settings
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@dataclass
class Scene:
    pki: PkiLayout
    a: SwitchThread
    b: SwitchThread
    c_ca: x509.Certificate
    c_key: ec.EllipticCurvePrivateKey
    work: Path
    auth_b: str

    def audit(self, event: str) -> list[dict[str, Any]]:
        path = Path(self.b.running.audit.path)
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [r for r in records if r["event"] == event]

    def trust_refusals(self) -> list[dict[str, Any]]:
        return [r["details"] for r in self.audit("link.refused") if r["details"]["layer"] == "trust"]

    def credentials(self, identity: Identity) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        cert, key = issue_certificate(self.c_ca, self.c_key, identity)
        return cert, key


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    work = tmp_path_factory.mktemp("scope")
    pki = init_pki(work / "pki", ["a", "b", "c"])
    a_ca = x509.load_pem_x509_certificate(pki.cluster("a").ca_cert.read_bytes())
    c_ca, c_key = unconstrained_ca(a_ca.subject)  # c's new root: no constraint, a's CA's very name
    add_trust(work / "pki", "b", "c", pem(c_ca))
    for cluster in "ab":
        (work / cluster).mkdir()
    with ExitStack() as stack:
        auth = stack.enter_context(running_auth(auth_settings(work / "b", "b")))
        b = SwitchThread(chain_settings(work, pki, "b", auth.address, peers="a,c", link_role="accept"))
        stack.callback(b.stop)
        auth_a = stack.enter_context(running_auth(auth_settings(work / "a", "a")))
        a = SwitchThread(
            chain_settings(
                work,
                pki,
                "a",
                auth_a.address,
                peer_cluster_id="b",
                peer_address=f"127.0.0.1:{b.running.wan_port}",
                link_role="dial",
            )
        )
        stack.callback(a.stop)
        link = b.running.links.get("a")
        assert link is not None
        wait_for(lambda: link.connected, 30, "the genuine a-b link")
        yield Scene(pki, a, b, c_ca, c_key, work, auth.address)


def _pem_pair(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[bytes, bytes]:
    return (
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )


def _grpc_credentials(scene: Scene, identity: Identity) -> grpc.ChannelCredentials:
    cert, key = scene.credentials(identity)
    return grpc.ssl_channel_credentials(
        root_certificates=scene.pki.cluster("b").ca_cert.read_bytes(),
        private_key=key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
        certificate_chain=cert.public_bytes(serialization.Encoding.PEM),
    )


def _wan(scene: Scene) -> str:
    return f"127.0.0.1:{scene.b.running.wan_port}"


def _refused_count(scene: Scene, rpc: str | None = None) -> int:
    return len([d for d in scene.trust_refusals() if rpc is None or d.get("rpc") == rpc])


def _session(scene: Scene) -> int:
    link = scene.b.running.links.get("a")
    assert link is not None and link.connected
    return link.state.sessions


def test_c_cannot_be_a_on_the_grpc_link(scene: Scene) -> None:
    sessions, before = _session(scene), _refused_count(scene)
    hello = link_pb2.LinkMessage(hello=link_pb2.Handshake(protocol_version=PROTOCOL_VERSION, cluster_id="a"))
    with grpc.secure_channel(
        _wan(scene),
        _grpc_credentials(scene, Identity("a", "switch")),
        options=channel_options(Identity("b", "switch")),
    ) as channel:
        call = link_pb2_grpc.SwitchLinkStub(channel).Link(iter([hello]), timeout=10)
        with pytest.raises(grpc.RpcError) as refused:
            for _ in call:
                pass
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "not issued by a CA this cluster trusts for cluster 'a'" in (refused.value.details() or "")
    wait_for(lambda: _refused_count(scene) > before, 10, "b to audit the impostor's gRPC link")
    assert scene.trust_refusals()[-1]["identity"] == "spiffe://nebula/cluster/a/switch"
    assert _session(scene) == sessions


def test_c_cannot_be_a_on_the_records_link(scene: Scene) -> None:
    sessions, before = _session(scene), _refused_count(scene)
    cert, key = scene.credentials(Identity("a", "switch"))
    context = openssl_context(
        *_pem_pair(cert, key), scene.pki.cluster("b").ca_cert.read_bytes(), server_side=False
    )

    async def attempt() -> str:
        try:
            connection: RawConnection = await dial_raw(
                _wan(scene), context, Identity("b", "switch").dns_name, timeout=10
            )
        except (OSError, HandshakeError, TimeoutError) as exc:
            return f"refused: {exc}"
        try:
            hello = link_pb2.Handshake(protocol_version=PROTOCOL_VERSION, cluster_id="a", raw_link=1)
            await connection.write(link_pb2.LinkMessage(hello=hello).SerializeToString())
            reply = await asyncio.wait_for(connection.read(), 10)
            return "answered" if isinstance(reply, bytes) else "closed"
        except (OSError, HandshakeError) as exc:
            return f"closed: {exc}"
        finally:
            await connection.close()

    outcome = asyncio.run(attempt())
    assert outcome != "answered", "b's records port answered an impostor's handshake"
    wait_for(lambda: _refused_count(scene) > before, 10, "b to audit the impostor's records link")
    assert _session(scene) == sessions


def test_c_cannot_reach_the_crl_exchange_as_a_nor_revoke_a_in_its_own_name(scene: Scene) -> None:
    sessions = _session(scene)
    before = _refused_count(scene, rpc="ExchangeCrl")
    with grpc.secure_channel(
        _wan(scene),
        _grpc_credentials(scene, Identity("a", "switch")),
        options=channel_options(Identity("b", "switch")),
    ) as channel:
        call = trust_pb2_grpc.SwitchTrustStub(channel).ExchangeCrl(iter([]), timeout=10)
        with pytest.raises(grpc.RpcError) as refused:
            for _ in call:
                pass
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    wait_for(lambda: _refused_count(scene, "ExchangeCrl") > before, 10, "b to audit the CRL impostor")

    # As itself, c sends a CRL issued in a's CA's name (its look-alike root signs it) revoking a's switch.
    a_switch = x509.load_pem_x509_certificate(scene.pki.cluster("a").switch_cert.read_bytes())
    forged = build_crl(scene.c_ca, scene.c_key, {a_switch.serial_number: datetime.now(UTC)}, number=99)
    forged_pem = forged.public_bytes(serialization.Encoding.PEM)
    updates = [
        trust_pb2.CrlUpdate(cluster_id="a", crl_pem=forged_pem, crl_number=99),  # in a's name: refused
        trust_pb2.CrlUpdate(cluster_id="c", crl_pem=forged_pem, crl_number=99),  # c's own list only
    ]
    a_trust = scene.b.running.links.get("a").revocation  # type: ignore[union-attr]
    c_trust = scene.b.running.links.get("c").revocation  # type: ignore[union-attr]
    assert a_trust is not None and c_trust is not None
    with grpc.secure_channel(
        _wan(scene),
        _grpc_credentials(scene, Identity("c", "switch")),
        options=channel_options(Identity("b", "switch")),
    ) as channel:
        refused_before = len(scene.audit("crl.refused"))
        call = trust_pb2_grpc.SwitchTrustStub(channel).ExchangeCrl(iter(updates), timeout=10)
        for _ in call:  # b answers with its own CRL; the stream ends when ours does
            pass
    refusals = scene.audit("crl.refused")[refused_before:]
    assert any("claims cluster 'a', expected 'c'" in r["details"]["reason"] for r in refusals), refusals
    wait_for(lambda: a_switch.serial_number in c_trust.crl_serials, 10, "the CRL to reach c's list only")
    assert a_switch.serial_number not in a_trust.crl_serials
    assert a_trust.check(a_switch) is None
    assert _session(scene) == sessions


def test_b_dialing_a_refuses_c_answering_in_a_s_place(scene: Scene) -> None:
    """The dialer's side: c takes over a's address (DNS, a route) and answers b with its a/switch
    certificate; b's dialer refuses it before any link message (audited, layer ``trust``)."""
    work = scene.work / "dialer"
    (work / "impostor").mkdir(parents=True)
    cert, key = scene.credentials(Identity("a", "switch"))
    cert_file, key_file = work / "impostor.crt", work / "impostor.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    with ExitStack() as stack:
        auth = stack.enter_context(running_auth(auth_settings(work / "impostor", "a")))
        impostor = SwitchThread(
            chain_settings(
                work / "impostor",
                scene.pki,
                "a",
                auth.address,
                peer_cluster_id="b",
                link_role="accept",
                tls_cert=cert_file,
                tls_key=key_file,
            )
        )
        stack.callback(impostor.stop)
        dialer = SwitchThread(
            chain_settings(
                work,
                scene.pki,
                "b",
                scene.auth_b,
                peer_cluster_id="a",
                peer_address=f"127.0.0.1:{impostor.running.wan_port}",
                link_role="dial",
            )
        )
        stack.callback(dialer.stop)
        path = Path(dialer.running.audit.path)

        def refused() -> list[dict[str, Any]]:
            records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            return [
                r["details"]
                for r in records
                if r["event"] == "link.refused" and r["details"]["layer"] == "trust"
            ]

        found = wait_for(refused, 20, "b's dialer to refuse c's a/switch certificate")
        assert "not issued by a CA this cluster trusts for cluster 'a'" in found[0]["reason"]
        assert not dialer.running.link.connected
