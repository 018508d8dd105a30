"""The records link refuses the peers the gRPC link refuses, two real switches, audited alike.

Both switches run the records link carrier (the default), so switch b's WAN port answers a sealed
offer (``NBLINK3\\n``) with pyOpenSSL's handshake (``nebula_common/rpc/exporter_tls.py``) and keys the
records from its exporter. An impostor dials that port as switch a would, with sealed records, but
with a certificate of another CA, an expired one, a revoked one (on a's CRL, which b has loaded) or one
of another role: b must refuse each -- ``tls`` for the first two (the handshake), ``revoked`` and
``identity`` after it, on the very certificate pyOpenSSL verified -- audit it as ``link.refused`` with
that layer, start no session and keep the genuine sealed link running. An older switch's offer
(``NBLINK1\\n`` or ``NBLINK2\\n``) is refused too, the audit naming what it offered. The dialer's own
check of b's name is pinned in ``tests/unit/test_sealed_identity.py``.
"""

from __future__ import annotations

import asyncio
import socket
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from nebula_common.pki import Identity, PkiLayout, init_pki, issue_certificate
from nebula_common.pki.lifecycle import revoke_certificate
from nebula_common.proto.nebula.v1 import link_pb2
from nebula_common.rpc.exporter_tls import openssl_context
from services.switch.link_handshake import PROTOCOL_VERSION, HandshakeError
from services.switch.rawlink_connection import OLD_PREAMBLES
from services.switch.rawlink_dialer import dial_raw
from tests.integration.test_switch_data_plane import (  # noqa: F401  (clusters: a module fixture)
    Cluster,
    clusters,
    switch_pair,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SEALED: dict[str, str] = {}  # the records carrier is the default


def _pem(cert: x509.Certificate, key: object) -> tuple[bytes, bytes]:
    return (
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(  # type: ignore[attr-defined]
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )


async def _attempt(address: str, material: tuple[bytes, bytes], bundle: bytes) -> str:
    """Dial b's WAN port offering sealed records with ``material``, say hello as switch a; what happened."""
    sealed = openssl_context(*material, bundle, server_side=False)
    try:
        connection = await dial_raw(address, sealed, Identity("b", "switch").dns_name, timeout=10)
    except (OSError, HandshakeError) as exc:
        return f"refused: {exc}"
    try:
        hello = link_pb2.Handshake(protocol_version=PROTOCOL_VERSION, cluster_id="a", raw_link=1)
        await connection.write(link_pb2.LinkMessage(hello=hello).SerializeToString())
        reply = await asyncio.wait_for(connection.read(), 10)
        return "closed: a clean end" if reply is grpc.aio.EOF else "answered"
    except (OSError, HandshakeError) as exc:
        return f"closed: {exc}"
    finally:
        await connection.close()


def test_a_sealed_offer_with_a_wrong_expired_or_revoked_certificate_is_refused_and_audited(
    tmp_path: Path,
    pki_ab: PkiLayout,
    clusters: dict[str, Cluster],  # noqa: F811
) -> None:
    paths_a = pki_ab.cluster("a")
    ca_a = x509.load_pem_x509_certificate(paths_a.ca_cert.read_bytes())
    ca_key_a = load_pem_private_key(paths_a.ca_key.read_bytes(), password=None)
    switch_a = Identity("a", "switch")
    now = datetime.now(UTC)
    stranger = init_pki(tmp_path / "stranger", ["a", "b"]).cluster("a")  # same names, another CA
    revoked, revoked_key = issue_certificate(ca_a, ca_key_a, switch_a, validity=timedelta(hours=1))  # type: ignore[arg-type]
    cases = {
        "another CA": (
            (stranger.switch_cert.read_bytes(), stranger.switch_key.read_bytes()),
            "tls",
            "certificate verify failed",
        ),
        "expired": (
            _pem(
                *issue_certificate(
                    ca_a,  # type: ignore[arg-type]
                    ca_key_a,  # type: ignore[arg-type]
                    switch_a,
                    not_before=now - timedelta(days=2),
                    validity=timedelta(days=1),
                )
            ),
            "tls",
            "certificate has expired",
        ),
        "revoked": (_pem(revoked, revoked_key), "revoked", "revoked"),
        "another role": (
            _pem(*issue_certificate(ca_a, ca_key_a, Identity("a", "operator"))),  # type: ignore[arg-type]
            "identity",
            "",
        ),
    }
    bundle = paths_a.trust_bundle.read_bytes()
    crls = {
        "peer_crl": pki_ab.cluster("b").trust_crl("a"),  # b loads a's CRL (and reloads it when it changes)
        "a_overrides": {"peer_crl": pki_ab.cluster("a").trust_crl("b")},
    }
    with switch_pair(tmp_path, pki_ab, clusters, **SEALED, **crls) as pair:
        assert pair.b.running.link.state.transport == "records"
        since = len(pair.audit("b", "crl.reload")) + len(pair.audit("b", "crl.apply"))
        revoke_certificate(pki_ab.root, "a", revoked.serial_number, reason="test: sealed path")
        wait_for(
            lambda: len(pair.audit("b", "crl.reload")) + len(pair.audit("b", "crl.apply")) > since,
            30,
            "switch b to load a's CRL with the revoked serial",
        )
        address = f"127.0.0.1:{pair.b.running.wan_port}"
        sessions = pair.b.running.link.state.sessions
        for name, (material, layer, reason) in cases.items():
            before = len(pair.audit("b", "link.refused"))
            outcome = asyncio.run(_attempt(address, material, bundle))
            assert outcome != "answered", f"{name}: the sealed raw port answered a handshake"
            records = wait_for(
                lambda before=before: pair.audit("b", "link.refused")[before:],
                10,
                f"b's audited refusal of the {name} certificate",
            )
            assert any(
                r["details"]["layer"] == layer and reason in r["details"]["reason"] for r in records
            ), (
                name,
                records,
            )
        # Older switches offered TLS records (NBLINK1) or self-keyed sealed ones (NBLINK2): each is
        # refused, the audit naming what it offered.
        for offered, named in OLD_PREAMBLES.items():
            before = len(pair.audit("b", "link.refused"))
            with socket.create_connection(("127.0.0.1", pair.b.running.wan_port), timeout=10) as old:
                old.sendall(offered)
                assert old.recv(64) == b"", f"the old offer {offered!r} was answered"
            records = wait_for(
                lambda before=before: pair.audit("b", "link.refused")[before:],
                10,
                f"b's refusal of {offered!r}",
            )
            assert records[0]["details"]["layer"] == "transport", records
            assert named in records[0]["details"]["reason"], records
            assert "update the older switch" in records[0]["details"]["reason"], records
        assert pair.b.running.link.state.sessions == sessions  # no session started or replaced
        assert pair.b.running.link.state.transport == "records"
