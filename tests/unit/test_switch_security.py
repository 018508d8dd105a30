"""The switch's certificate manager, TLS-refusal parser and transfer ledger, on real files."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from nebula_common.audit import open_service_audit
from nebula_common.pki import Identity, PkiLayout, init_pki
from nebula_common.proto.nebula.v1 import link_pb2, relay_pb2, tensor_pb2
from services.switch.certs import CertificateManager
from services.switch.tls_refusals import parse_refusal
from services.switch.transfers import StepTotals, TransferKey, TransferLedger

pytestmark = pytest.mark.timeout(60)


def test_switch_renews_itself_before_expiry_and_serves_the_new_pair(tmp_path: Path) -> None:
    layout = init_pki(tmp_path / "pki", ["a", "b"], leaf_validity=timedelta(hours=3))
    a = layout.cluster("a")
    with open_service_audit(tmp_path / "data", service="switch", cluster="a") as audit:
        manager = CertificateManager(
            a.switch_cert,
            a.switch_key,
            a.trust_bundle,
            Identity("a", "switch"),
            audit=audit,
            ca_cert_path=a.ca_cert,
            ca_key_path=a.ca_key,
        )
        first = manager.current
        assert manager.check() is None  # nothing due, nothing changed
        manager.server_credentials()  # what the WAN server is built with: generation 1
        assert manager._fetch() is None  # the server already has generation 1
        # Two hours later less than a third of the lifetime is left: renewal is due.
        renewed = manager.check(now=datetime.now(UTC) + timedelta(hours=2, minutes=30))
        assert renewed is not None and renewed.serial != first.serial and renewed.generation == 2
        assert renewed.lifetime() == first.lifetime()
        assert manager._fetch() is not None and manager._fetch() is None  # handed to gRPC exactly once
        on_disk = a.switch_cert.read_bytes()
        assert on_disk == renewed.cert_pem
        # A half-written rotation (new key, old certificate) is never served.
        a.switch_key.write_bytes(
            serialization.load_pem_private_key(first.key_pem, None).private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        assert manager.check() is None and manager.current.serial == renewed.serial
    events = [
        json.loads(line)["event"] for line in (tmp_path / "data" / "audit.log").read_text().splitlines()
    ]
    assert events.count("cert.renew") == 1 and events.count("cert.reload") == 1


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (
            b"I1123 03:03:47.849865 11453 ssl_transport_security.cc:2563] Handshake failed with error "
            b"SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: "
            b"certificate has expired",
            "CERTIFICATE_VERIFY_FAILED: certificate has expired",
        ),
        (b'{"severity": "INFO", "message": "WAN link up"}', None),
    ],
)
def test_tls_refusal_lines_are_recognised(line: bytes, reason: str | None) -> None:
    assert parse_refusal(line) == reason


def routed(item: relay_pb2.EdgeMessage) -> link_pb2.LinkMessage:
    return link_pb2.LinkMessage(routed=link_pb2.RoutedItem(job_id="j", edge="e", item=item))


def test_transfer_ledger_emits_one_summary_per_step_and_direction() -> None:
    emitted: list[tuple[TransferKey, StepTotals]] = []
    ledger = TransferLedger(lambda key, totals: emitted.append((key, totals)))

    def frame(step: int, frame_id: int) -> list[link_pb2.LinkMessage]:
        header = tensor_pb2.TensorHeader(
            step=step, frame_id=frame_id, codec="fp16", raw_size=400, payload_size=200
        )
        chunk = tensor_pb2.TensorChunk(frame_id=frame_id, data=b"x" * 200, last=True)
        return [
            routed(relay_pb2.EdgeMessage(frame=tensor_pb2.TensorFrame(header=header))),
            routed(relay_pb2.EdgeMessage(frame=tensor_pb2.TensorFrame(chunk=chunk))),
            routed(relay_pb2.EdgeMessage(signal=relay_pb2.EdgeSignal(seq=frame_id + 100))),  # not counted
        ]

    for step in range(3):
        for micro, message in enumerate(frame(step, 2 * step + 1) + frame(step, 2 * step + 2)):
            ledger.observe("sent", message)
            del micro
    ledger.observe("sent", routed(relay_pb2.EdgeMessage(close=relay_pb2.EdgeClose(reason="finished"))))
    assert [(k, t.step, t.frames, t.payload_bytes, t.raw_bytes) for k, t in emitted] == [
        (("j", "e", "sent"), step, 2, 400, 800) for step in range(3)
    ]
    assert all(t.codecs == {"fp16"} for _, t in emitted)


@contextlib.contextmanager
def _switch_managers(tmp_path: Path) -> Iterator[tuple[PkiLayout, dict[str, CertificateManager]]]:
    """The PKI and certificate managers of switches a and b (3-hour leaves: a renewal can be forced)."""
    layout = init_pki(tmp_path / "pki", ["a", "b"], leaf_validity=timedelta(hours=3))
    with (
        open_service_audit(tmp_path / "a", service="switch", cluster="a") as audit_a,
        open_service_audit(tmp_path / "b", service="switch", cluster="b") as audit_b,
    ):
        managers = {}
        for cluster, audit in (("a", audit_a), ("b", audit_b)):
            paths = layout.cluster(cluster)
            managers[cluster] = CertificateManager(
                paths.switch_cert,
                paths.switch_key,
                paths.trust_bundle,
                Identity(cluster, "switch"),
                audit=audit,
                ca_cert_path=paths.ca_cert,
                ca_key_path=paths.ca_key,
            )
        yield layout, managers


def test_sealed_records_openssl_contexts_follow_renewal_and_complete_a_mutual_handshake(
    tmp_path: Path,
) -> None:
    """The records link's contexts come from the current material: cached per generation, the renewed
    leaf presented after a renewal, without a restart."""
    import socket
    import threading
    import time

    from nebula_common.rpc.exporter_tls import handshake

    with _switch_managers(tmp_path) as (_layout, managers):
        server = managers["b"].openssl_context(server_side=True)
        assert server is managers["b"].openssl_context(server_side=True)  # cached per generation
        before = managers["a"].openssl_context(server_side=False)
        renewed = managers["a"].check(now=datetime.now(UTC) + timedelta(hours=2, minutes=30))
        assert renewed is not None
        client = managers["a"].openssl_context(server_side=False)
        assert client is not before  # a new generation, a new context

        left, right = socket.socketpair()
        seen: dict[str, object] = {}
        deadline = time.monotonic() + 10

        def serve() -> None:
            seen["client"] = handshake(right, server, server_name=None, deadline=deadline)[1]

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        _, presented_server = handshake(
            left, client, server_name=Identity("b", "switch").dns_name, deadline=deadline
        )
        thread.join(10)
        left.close()
        right.close()
        assert presented_server.serial_number == managers["b"].current.serial
        assert getattr(seen["client"], "serial_number", None) == renewed.serial  # the renewed leaf
