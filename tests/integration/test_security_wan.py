"""The WAN port under attack and under maintenance, on the real switch processes.

* the negative mTLS matrix: every bad client is refused before a frame is relayed, and audited;
* revocation: `nebula pki revoke` closes the live link within seconds, and the link comes back
  once the revoked switch gets a new certificate;
* rotation: both switches get new certificates mid-job, the live link survives (same session),
  new handshakes see the new certificates, and every step crosses the WAN exactly once.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from nebula_common.audit import SealVerifier, verify_log
from nebula_common.cli.app import app
from nebula_common.launcher import LocalDeployment
from nebula_common.metrics import read_metrics
from nebula_common.pki import Identity, channel_options, create_ca, issue_certificate, load_layout
from nebula_common.pki.lifecycle import renew_switch_certificate
from nebula_common.proto.nebula.v1 import (
    audit_pb2,
    audit_pb2_grpc,
    link_pb2,
    link_pb2_grpc,
    relay_pb2,
    tensor_pb2,
    trainer_pb2,
)
from nebula_common.rpc import bearer_metadata
from nebula_common.sdk.auth_client import AuthClient
from nebula_common.sdk.client import ClusterSession, submit_job
from services.switch.link_handshake import PROTOCOL_VERSION, fetch_server_certificate
from tests.support.internal import user_channel
from tests.support.jobs import numbers_job
from tests.support.tls_probe import handshakes_without_certificate
from tests.support.waiting import wait_for

_wait_for = functools.partial(wait_for, interval=0.1)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _a_ca(deployment: LocalDeployment) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    paths = load_layout(deployment.pki_dir, ["a"]).cluster("a")
    key = serialization.load_pem_private_key(paths.ca_key.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return x509.load_pem_x509_certificate(paths.ca_cert.read_bytes()), key


def _admin_metadata(deployment: LocalDeployment, cluster: str) -> tuple[tuple[str, str], ...]:
    with AuthClient(deployment.endpoints(cluster).auth) as auth:
        token = auth.login("admin", deployment.cluster_state[cluster].admin_password).token
    return bearer_metadata(token)


def _audit(deployment: LocalDeployment, cluster: str, **query: Any) -> list[dict[str, Any]]:
    with user_channel(deployment.endpoints(cluster).switch, "switch") as channel:
        reply = audit_pb2_grpc.AuditLogStub(channel).Query(
            audit_pb2.AuditQuery(**query), metadata=_admin_metadata(deployment, cluster), timeout=10
        )
    return [json.loads(r) for r in reply.records_json]


def _try_link(
    deployment: LocalDeployment, credentials: grpc.ChannelCredentials, job_id: str
) -> grpc.StatusCode:
    """Open SwitchLink.Link on b's WAN port, send a handshake and a frame; return the refusal code."""
    address = f"127.0.0.1:{deployment.cluster_state['b'].switch.info['wan_port']}"  # type: ignore[union-attr]
    header = tensor_pb2.TensorHeader(
        job_id=job_id, edge="probe", step=0, frame_id=1, codec="none", raw_size=4
    )
    messages = [
        link_pb2.LinkMessage(hello=link_pb2.Handshake(protocol_version=PROTOCOL_VERSION, cluster_id="a")),
        link_pb2.LinkMessage(
            routed=link_pb2.RoutedItem(
                job_id=job_id,
                edge="probe",
                item=relay_pb2.EdgeMessage(frame=tensor_pb2.TensorFrame(header=header)),
            )
        ),
    ]
    with grpc.secure_channel(
        address, credentials, options=channel_options(Identity("b", "switch"))
    ) as channel:
        call = link_pb2_grpc.SwitchLinkStub(channel).Link(iter(messages), timeout=5)
        with pytest.raises(grpc.RpcError) as refused:
            for _ in call:
                pass
    return refused.value.code()


def test_negative_mtls_matrix_is_refused_before_any_frame_and_audited(
    deployment: LocalDeployment, sessions: dict[str, ClusterSession]
) -> None:
    roots = (deployment.pki_dir / "a" / "trust-bundle.pem").read_bytes()  # b's CA: the client verifies b
    a_ca, a_key = _a_ca(deployment)
    rogue_ca, rogue_key = create_ca("a")
    now = datetime.now(UTC)

    def creds(
        cert: x509.Certificate | None, key: ec.EllipticCurvePrivateKey | None
    ) -> grpc.ChannelCredentials:
        if cert is None or key is None:
            return grpc.ssl_channel_credentials(root_certificates=roots)
        return grpc.ssl_channel_credentials(roots, _pem_key(key), _pem_cert(cert))

    a_switch = Identity("a", "switch")
    revoked_cert, revoked_key = issue_certificate(a_ca, a_key, a_switch, validity=timedelta(hours=1))
    outcome = CliRunner().invoke(
        app,
        [
            "pki",
            "revoke",
            "--dir",
            str(deployment.pki_dir),
            "--cluster",
            "a",
            "--serial",
            f"{revoked_cert.serial_number:x}",
            "--reason",
            "matrix test",
        ],
    )
    assert outcome.exit_code == 0, outcome.output
    # b gets the new CRL over the WAN port (crl.apply) or from its file copy (crl.reload), whichever is first.
    _wait_for(
        lambda: (
            _audit(deployment, "b", event="crl.apply", since_unix=now.timestamp() - 1)
            or _audit(deployment, "b", event="crl.reload", since_unix=now.timestamp() - 1)
        ),
        10,
        "CRL reload",
    )

    cases: dict[str, tuple[grpc.ChannelCredentials, grpc.StatusCode, str, str]] = {
        "no certificate": (
            creds(None, None),
            grpc.StatusCode.UNAVAILABLE,
            "tls",
            "PEER_DID_NOT_RETURN_A_CERTIFICATE",
        ),
        "unknown CA": (
            creds(*issue_certificate(rogue_ca, rogue_key, a_switch)),
            grpc.StatusCode.UNAVAILABLE,
            "tls",
            "CERTIFICATE_VERIFY_FAILED",
        ),
        "expired": (
            creds(
                *issue_certificate(
                    a_ca, a_key, a_switch, not_before=now - timedelta(days=2), validity=timedelta(days=1)
                )
            ),
            grpc.StatusCode.UNAVAILABLE,
            "tls",
            "certificate has expired",
        ),
        "not yet valid": (
            creds(
                *issue_certificate(
                    a_ca, a_key, a_switch, not_before=now + timedelta(days=1), validity=timedelta(days=1)
                )
            ),
            grpc.StatusCode.UNAVAILABLE,
            "tls",
            "not yet valid",
        ),
        "revoked": (
            creds(revoked_cert, revoked_key),
            grpc.StatusCode.PERMISSION_DENIED,
            "revoked",
            "revoked",
        ),
        # a's CA is name-constrained to a.nebula.internal: it cannot vouch for cluster c.
        "wrong cluster": (
            creds(*issue_certificate(a_ca, a_key, Identity("c", "switch"))),
            grpc.StatusCode.UNAVAILABLE,
            "tls",
            "CERTIFICATE_VERIFY_FAILED",
        ),
        "wrong role": (
            creds(*issue_certificate(a_ca, a_key, Identity("a", "operator"))),
            grpc.StatusCode.PERMISSION_DENIED,
            "identity",
            "only spiffe://nebula/cluster/a/switch",
        ),
    }
    for name, (credentials, code, layer, reason) in cases.items():
        since = time.time()
        job_id = "matrix-" + name.replace(" ", "-")
        assert _try_link(deployment, credentials, job_id) == code, name

        def refused(layer: str = layer, reason: str = reason, since: float = since) -> list[dict[str, Any]]:
            records = _audit(deployment, "b", event="link.refused", since_unix=since)
            return [r for r in records if r["details"]["layer"] == layer and reason in r["details"]["reason"]]

        record = _wait_for(refused, 5, f"audit record of the {name} refusal")[0]
        assert record["outcome"] == "refused"
        # Not one frame of the impostor reached routing or the transfer accounting.
        assert _audit(deployment, "b", job_id=job_id) == [], name

    # The genuine link was never disturbed, and the audit log of b is intact.
    assert sessions["b"].link_status().connected
    data_dir = deployment.run_dir / "b" / "switch"
    result = verify_log(
        data_dir / "audit.log",
        SealVerifier.from_file(data_dir / "audit-key.pub.pem"),
        require_seal_file=False,
    )
    assert result.ok, result


def test_audit_query_is_admin_only(deployment: LocalDeployment, sessions: dict[str, ClusterSession]) -> None:
    with user_channel(deployment.endpoints("a").switch, "switch") as channel:
        stub = audit_pb2_grpc.AuditLogStub(channel)
        for metadata, code in (
            (sessions["a"].metadata, grpc.StatusCode.PERMISSION_DENIED),
            (sessions["b"].metadata, grpc.StatusCode.UNAUTHENTICATED),
            ((), grpc.StatusCode.UNAUTHENTICATED),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                stub.Query(audit_pb2.AuditQuery(), metadata=metadata, timeout=5)
            assert refused.value.code() == code
        key = stub.GetAuditKey(
            audit_pb2.GetAuditKeyRequest(), metadata=_admin_metadata(deployment, "a"), timeout=5
        )
    on_disk = (deployment.run_dir / "a" / "switch" / "audit-key.pub.pem").read_text()
    assert key.public_key_pem == on_disk and key.service == "switch" and len(key.key_id) == 16


def _status(session: ClusterSession) -> relay_pb2.LinkStatus:
    return session.link_status()


def test_revoking_the_live_peer_closes_the_link_within_seconds_and_renewal_restores_it(
    deployment: LocalDeployment, sessions: dict[str, ClusterSession]
) -> None:
    _wait_for(lambda: _status(sessions["b"]).connected, 30, "link up")
    live_serial = _status(sessions["b"]).peer_certificate_serial
    a_cert = x509.load_pem_x509_certificate((deployment.pki_dir / "a" / "switch.crt").read_bytes())
    assert live_serial == f"{a_cert.serial_number:x}"

    started = time.monotonic()
    outcome = CliRunner().invoke(
        app,
        [
            "pki",
            "revoke",
            "--dir",
            str(deployment.pki_dir),
            "--cluster",
            "a",
            "--cert",
            str(deployment.pki_dir / "a" / "switch.crt"),
            "--reason",
            "key compromise drill",
        ],
    )
    assert outcome.exit_code == 0, outcome.output
    _wait_for(lambda: not _status(sessions["b"]).connected, 10, "b to close the link")
    closed_after = time.monotonic() - started
    assert closed_after < 5.0, closed_after
    # It stays closed: a keeps redialling with the revoked certificate and b keeps refusing.
    time.sleep(2.0)
    assert not _status(sessions["b"]).connected
    refusals = _audit(deployment, "b", event="link.refused")
    assert any(
        r["details"]["layer"] == "revoked" and "during the session" in r["details"]["reason"]
        for r in refusals
    )

    renewed = renew_switch_certificate(deployment.pki_dir, "a", validity=timedelta(hours=2))
    _wait_for(lambda: _status(sessions["b"]).connected, 30, "the link to come back with a's new certificate")
    assert _status(sessions["b"]).peer_certificate_serial == f"{renewed.serial_number:x}"
    print(f"revoked link closed after {closed_after:.2f}s")


@pytest.mark.faults  # rotates both switches' certificates under a running job (`make test-faults`)
def test_job_keeps_running_across_certificate_rotation_of_both_switches(
    deployment: LocalDeployment, sessions: dict[str, ClusterSession]
) -> None:
    _wait_for(lambda: _status(sessions["a"]).connected and _status(sessions["b"]).connected, 30, "link up")
    before = {c: _status(s) for c, s in sessions.items()}
    job = numbers_job(steps=30, data__batch_size=32, data__micro_batches=1)
    handle = submit_job(job, sessions)
    rotated: dict[str, x509.Certificate] = {}
    rotated_at_step = -1
    steps_seen: dict[str, list[int]] = {"encoder": [], "decoder": []}
    for update in handle.updates():
        status = update.status
        if status.state == trainer_pb2.STAGE_STATE_RUNNING and status.HasField("loss"):
            steps_seen[status.stage].append(int(status.steps_done))
        if not rotated and status.steps_done >= 5:
            rotated = {
                c: renew_switch_certificate(deployment.pki_dir, c, validity=timedelta(hours=2)) for c in "ab"
            }
            for cluster, cert in rotated.items():
                _wait_for(
                    lambda c=cluster, s=cert: (
                        _status(sessions[c]).certificate_serial == f"{s.serial_number:x}"
                    ),
                    15,
                    f"switch {cluster} to hot-reload",
                )
            rotated_at_step = int(status.steps_done)
    assert rotated, "the job ended before the rotation"
    assert 0 < rotated_at_step < job.steps - 5
    assert {s.state for s in handle.final.values()} == {trainer_pb2.STAGE_STATE_SUCCEEDED}, handle.final
    for stage, seen in steps_seen.items():
        assert seen == sorted(set(seen)), (stage, seen)  # no step reported twice or out of order
    after = {c: _status(s) for c, s in sessions.items()}
    for cluster in "ab":
        # Same live link throughout: the rotation did not force a reconnect.
        assert after[cluster].link_sessions == before[cluster].link_sessions, cluster
        assert after[cluster].certificate_generation > before[cluster].certificate_generation
    # New handshakes get the new certificate.
    a_paths = load_layout(deployment.pki_dir, ["a"]).cluster("a")
    b_wan = f"127.0.0.1:{deployment.cluster_state['b'].switch.info['wan_port']}"  # type: ignore[union-attr]
    served = asyncio.run(
        fetch_server_certificate(
            b_wan, a_paths.switch_cert, a_paths.switch_key, a_paths.trust_bundle, "switch.b.nebula.internal"
        )
    )
    assert served.serial_number == rotated["b"].serial_number
    # Every step crossed the WAN exactly once in each direction, as b's switch accounted it (the
    # start barrier is a READY signal, not a tensor frame, so it has no transfer record).
    transfers = _audit(deployment, "b", event="transfer", job_id=job.job_id)
    for direction in ("received", "sent"):
        steps = [r["details"]["step"] for r in transfers if r["details"]["direction"] == direction]
        assert sorted(steps) == list(range(job.steps)), (direction, steps)


def _wan_refusals(deployment: LocalDeployment) -> float:
    text = read_metrics(deployment.endpoints("b").metrics["switch-b"])
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "nebula_switch_refusals_total" and sample.labels.get("port") == "wan"
    )


def test_a_strangers_flood_of_handshakes_leaves_a_handful_of_audit_records(
    deployment: LocalDeployment, sessions: dict[str, ClusterSession]
) -> None:
    """300 TLS handshakes without a certificate on b's WAN port: each is refused and counted, but the
    audit log gets one record per source, layer and reason per interval (the first at once, the repeats
    as one record with their count), so a stranger cannot fill the disk; the genuine link is undisturbed."""
    address = ("127.0.0.1", deployment.cluster_state["b"].switch.info["wan_port"])  # type: ignore[union-attr]
    since, before = time.time(), _wan_refusals(deployment)
    attempts = 300
    handshakes_without_certificate(address, attempts)
    counted = f"{attempts} refusals counted on b's WAN port"
    _wait_for(lambda: _wan_refusals(deployment) - before >= attempts, 60, counted)
    flood_s = time.time() - since  # until the switch had refused the last one

    # The repeats arrive as counted records at the end of the interval (2 s in these tests).
    def counted_records() -> list[dict[str, Any]]:
        records = _audit(deployment, "b", event="link.refused", since_unix=since)
        return records if sum(r["details"]["count"] for r in records) >= attempts else []

    records = _wait_for(counted_records, 30, f"audit records counting the {attempts} refusals")
    interval = max(r["details"].get("repeats_within_s", 0.0) for r in records)
    assert interval > 0, [r["details"] for r in records]  # some repeats were counted, not written
    # Per interval the flood touched and per layer and reason: its first refusal at once, its repeats as
    # one counted record. On a busy host the 300 handshakes span more intervals; one record per handshake
    # fails either bound.
    spanned = math.ceil(flood_s / interval) + 1
    keys = len({(r["details"]["layer"], r["details"]["reason"]) for r in records})
    print(f"{attempts} refused handshakes in {flood_s:.1f} s: {len(records)} audit records, {keys} reasons")
    bound = min(2 * spanned * keys, attempts // 10)
    assert len(records) <= bound, (flood_s, [r["details"] for r in records])
    assert sessions["b"].link_status().connected
