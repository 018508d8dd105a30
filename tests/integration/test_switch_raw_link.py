"""The records link carrier (services/switch/rawlink.py) between two real switches.

* agreed: each carrier (records, the default, and grpc) carries framed chunks byte for byte and is
  audited by name; two switches whose carriers differ refuse each other, each refusal audited with both
  carriers named, and no session starts;
* authenticated as the gRPC link is: no client certificate, an untrusted CA, a certificate of the right
  CA naming another role, a handshake contradicting the certificate or announcing no link framing, and a
  hello confirming another preamble than the one that crossed in clear are refused and audited, and no
  session starts;
* lanes over records connections: striping in order, losing one connection mid-transfer, retiring one
  (the data-plane tests of test_switch_data_plane.py, run on the records carrier).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from OpenSSL import SSL, crypto

from nebula_common.pki import Identity, PkiLayout, init_pki, issue_certificate
from nebula_common.proto.nebula.v1 import link_pb2
from nebula_common.rpc.exporter_tls import openssl_context
from nebula_common.rpc.framing import LINK_FRAMING_VERSION, encode_chunk
from services.switch.link_handshake import PROTOCOL_VERSION, HandshakeError
from services.switch.rawlink_connection import PREAMBLE, RawConnection
from services.switch.rawlink_dialer import dial_raw
from tests.integration import test_switch_data_plane as plane
from tests.integration.test_switch_data_plane import (  # noqa: F401  (clusters: a module fixture)
    Cluster,
    EdgeClient,
    Pair,
    SwitchThread,
    clusters,
    frame,
    switch_pair,
    switch_settings,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _cross(pair: Pair, accounts: dict[str, Cluster], job: str) -> None:
    """A framed 1 MiB chunk from a trainer at switch a reaches one at switch b as the same bytes."""
    payload = bytes(range(256)) * 4096
    sender = EdgeClient(pair.a, accounts["a"].tokens["alice"], job)
    receiver = EdgeClient(pair.b, accounts["b"].tokens["alice"], job)
    for end in (sender, receiver):
        end.expect("ready")
    raw, _ = encode_chunk(job, "e", 0, 1, 0, payload, True)
    sender.send(frame(1))
    sender.send(raw)
    receiver.expect("frame")
    assert receiver.expect_framed() == raw
    for end in (sender, receiver):
        end.finish()


@pytest.mark.parametrize("carrier", ["records", "grpc"])
def test_each_carrier_carries_chunks_byte_for_byte_and_is_audited_by_name(
    tmp_path: Path,
    pki_ab: PkiLayout,
    clusters: dict[str, Cluster],  # noqa: F811
    carrier: str,
) -> None:
    overrides = {} if carrier == "records" else {"link_carrier": carrier}  # records: the default
    with switch_pair(tmp_path, pki_ab, clusters, **overrides) as pair:
        for switch in (pair.a, pair.b):
            assert switch.running.link.state.transport == carrier
        # The link's state is set just before its link.up record is written (on the switch's own loop).
        ups = wait_for(lambda: pair.audit("b", "link.up"), 10, "switch b's link.up audit record")
        assert ups[-1]["details"]["transport"] == carrier
        frontend = pair.b.running.frontend
        assert frontend is not None and frontend.serves_raw == (carrier == "records")
        _cross(pair, clusters, f"carried-{carrier}")
        assert pair.a.running.link.state.sessions == 1  # one session: the offer itself started none


@pytest.mark.parametrize(("b_carrier", "a_carrier"), [("records", "grpc"), ("grpc", "records")])
def test_switches_whose_carriers_differ_refuse_each_other_and_audit_both_carriers(
    tmp_path: Path,
    pki_ab: PkiLayout,
    clusters: dict[str, Cluster],  # noqa: F811
    b_carrier: str,
    a_carrier: str,
) -> None:
    b = SwitchThread(
        switch_settings(
            tmp_path, pki_ab, "b", "a", clusters["b"].auth.address, link_role="accept", link_carrier=b_carrier
        )
    )
    try:
        a = SwitchThread(
            switch_settings(
                tmp_path,
                pki_ab,
                "a",
                "b",
                clusters["a"].auth.address,
                link_role="dial",
                peer_address=f"127.0.0.1:{b.running.wan_port}",
                link_carrier=a_carrier,
            )
        )
        try:
            pair = Pair(a, b)

            def refused() -> list[dict[str, Any]]:
                return [r for r in pair.audit("b", "link.refused") if r["details"]["layer"] == "transport"]

            records = wait_for(refused, 30, "switch b's transport refusal of a's carrier")
            reason = records[-1]["details"]["reason"]
            assert f"the peer's link carrier is {a_carrier}, this switch's is {b_carrier}" in reason, reason
            assert "NEBULA_SWITCH_LINK_CARRIER" in reason
            # Refused before any session: neither switch ever had one.
            for switch in (a, b):
                assert not switch.running.link.connected
                assert switch.running.link.state.sessions == 0
        finally:
            a.stop()
    finally:
        b.stop()


def _context(material: tuple[bytes, bytes] | None, bundle: Path) -> SSL.Context:
    """A client context offering ``material`` (no certificate at all when None)."""
    if material is not None:
        return openssl_context(*material, bundle.read_bytes(), server_side=False)
    context = SSL.Context(SSL.TLS_METHOD)
    context.set_min_proto_version(SSL.TLS1_3_VERSION)
    store = context.get_cert_store()
    assert store is not None
    for trusted in x509.load_pem_x509_certificates(bundle.read_bytes()):
        store.add_cert(crypto.X509.from_cryptography(trusted))
    context.set_verify(SSL.VERIFY_PEER)
    return context


def _pem_pair(cert: Any, key: Any) -> tuple[bytes, bytes]:
    return (
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )


async def _attempt(
    address: str,
    context: SSL.Context,
    claim: str,
    preamble: bytes = PREAMBLE,
    link_framing: int = LINK_FRAMING_VERSION,
) -> str:
    """Dial with records, send a handshake claiming ``claim``, to have sent ``preamble`` in clear and
    ``link_framing``; what happened (the refusal shows as a closed link)."""
    try:
        connection: RawConnection = await dial_raw(
            address, context, Identity("b", "switch").dns_name, timeout=10
        )
    except (OSError, HandshakeError, TimeoutError) as exc:
        return f"refused: {exc}"
    try:
        hello = link_pb2.LinkMessage(
            hello=link_pb2.Handshake(
                protocol_version=PROTOCOL_VERSION,
                cluster_id=claim,
                raw_link=1,
                raw_preamble=preamble,
                link_framing=link_framing,
            )
        )
        await connection.write(hello.SerializeToString())
        reply = await asyncio.wait_for(connection.read(), 10)
        return "answered" if isinstance(reply, bytes) else "closed"
    except (OSError, HandshakeError) as exc:
        return f"closed: {exc}"
    finally:
        await connection.close()


def test_the_records_port_refuses_what_the_grpc_link_refuses_and_audits_it(
    tmp_path: Path,
    pki_ab: PkiLayout,
    clusters: dict[str, Cluster],  # noqa: F811
) -> None:
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    paths_a = pki_ab.cluster("a")
    ca_a = x509.load_pem_x509_certificate(paths_a.ca_cert.read_bytes())
    ca_key_a = load_pem_private_key(paths_a.ca_key.read_bytes(), password=None)
    operator, operator_key = issue_certificate(
        ca_a, ca_key_a, Identity("a", "operator"), validity=timedelta(hours=1)
    )
    stranger = init_pki(tmp_path / "stranger", ["a", "b"]).cluster("a")  # same names, another CA
    bundle = paths_a.trust_bundle
    genuine = _pem_pair(
        x509.load_pem_x509_certificate(paths_a.switch_cert.read_bytes()),
        load_pem_private_key(paths_a.switch_key.read_bytes(), password=None),
    )
    cases = {
        "no client certificate": (None, "a", "tls"),
        "untrusted CA": (
            _pem_pair(
                x509.load_pem_x509_certificate(stranger.switch_cert.read_bytes()),
                load_pem_private_key(stranger.switch_key.read_bytes(), password=None),
            ),
            "a",
            "tls",
        ),
        "another role": (_pem_pair(operator, operator_key), "a", "identity"),
        "handshake lies": (genuine, "z", "handshake"),
        "no link framing": (genuine, "a", "handshake"),
        # The genuine switch a, saying inside TLS that it sent another preamble than b received in clear.
        "preamble differs": (genuine, "a", "transport"),
    }
    with switch_pair(tmp_path, pki_ab, clusters) as pair:
        address = f"127.0.0.1:{pair.b.running.wan_port}"
        sessions = pair.b.running.link.state.sessions
        for name, (material, claim, layer) in cases.items():
            before = len([r for r in pair.audit("b", "link.refused") if r["details"]["layer"] == layer])
            said = b"NBLINK9\n" if name == "preamble differs" else PREAMBLE
            framing = 0 if name == "no link framing" else LINK_FRAMING_VERSION
            outcome = asyncio.run(_attempt(address, _context(material, bundle), claim, said, framing))
            assert outcome != "answered", f"{name}: the records port answered a handshake"
            wait_for(
                lambda layer=layer, before=before: (
                    len([r for r in pair.audit("b", "link.refused") if r["details"]["layer"] == layer])
                    > before
                ),
                10,
                f"a {layer} refusal audited for {name}",
            )
        assert pair.b.running.link.state.sessions == sessions  # no session started or replaced
        assert pair.b.running.link.state.transport == "records"
        _cross(pair, clusters, "still-linked")


@pytest.mark.parametrize(
    "test",
    [
        plane.test_items_striped_over_several_connections_arrive_in_order_both_ways,
        plane.test_losing_one_connection_mid_transfer_loses_nothing_and_the_tensors_arrive_exactly,
        plane.test_a_retired_connection_hands_over_without_losing_or_reordering_items,
    ],
    ids=["striped", "one-lost", "retired"],
)
def test_lanes_over_records_connections(
    test: Callable[..., None],
    tmp_path: Path,
    pki_ab: PkiLayout,
    clusters: dict[str, Cluster],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = plane.switch_pair

    def checked_pair(*args: Any, **kwargs: Any) -> Any:
        class Checked:
            def __enter__(self) -> Pair:
                self.inner = original(*args, **kwargs)
                pair = self.inner.__enter__()
                assert pair.a.running.link.state.transport == "records"
                return pair

            def __exit__(self, *exc: Any) -> Any:
                return self.inner.__exit__(*exc)

        return Checked()

    monkeypatch.setattr(plane, "switch_pair", checked_pair)
    test(tmp_path, pki_ab, clusters)
