"""The rank store's gate: only this cluster's workers get to the store, and only signed specs run.

Real pieces throughout: a torch TCPStore on loopback, the gate and the tunnel on real sockets with
TLS 1.3, certificates from a real two-cluster PKI. The strangers: a plain TCPStore client, TLS without
a certificate, a service of the cluster that is not a worker, a worker of the other cluster, and a
"trainer" that is not one; and specs forged, replayed under another number, or signed by a worker.
"""

from __future__ import annotations

import datetime
import logging
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from nebula_common.pki import PkiLayout
from nebula_common.pki.service_identity import (
    ServiceTlsFiles,
    ensure_service_certificates,
    issue_service_certificate,
)
from services.trainer.runtime.rank_gate import (
    RankAuthError,
    RankGate,
    RankTls,
    RankTunnel,
    sign_spec,
    verify_spec,
)
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(120)
SHORT = datetime.timedelta(seconds=3)


@pytest.fixture(scope="module")
def identities(pki_ab: PkiLayout) -> dict[str, ServiceTlsFiles]:
    root = pki_ab.root
    services = ensure_service_certificates(root, "a")
    return {
        "trainer": services["trainer"],
        "data": services["data"],
        "worker": issue_service_certificate(root, "a", "worker"),
        "worker-b": issue_service_certificate(root, "b", "worker"),
    }


@pytest.fixture
def gate(identities: dict[str, ServiceTlsFiles]) -> Iterator[tuple[dist.TCPStore, RankGate]]:
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=SHORT, wait_for_workers=False)
    running = RankGate("127.0.0.1:0", store.port, RankTls(identities["trainer"], "a"))
    yield store, running
    running.close()


def test_a_worker_of_the_cluster_reaches_the_store_through_its_tunnel(
    identities: dict[str, ServiceTlsFiles], gate: tuple[dist.TCPStore, RankGate]
) -> None:
    store, running = gate
    tunnel = RankTunnel(f"127.0.0.1:{running.port}", RankTls(identities["worker"], "a"))
    try:
        client = dist.TCPStore("127.0.0.1", tunnel.port, is_master=False, timeout=SHORT)
        client.set("worker/0", "hello")
        assert store.get("worker/0") == b"hello"
        store.set("stage/0/spec", b"x" * 300_000)
        assert client.get("stage/0/spec") == b"x" * 300_000  # larger than one TLS record
    finally:
        tunnel.close()


def test_a_tunnel_closes_after_the_workers_own_clients_so_its_box_cannot_use_it(
    identities: dict[str, ServiceTlsFiles], gate: tuple[dist.TCPStore, RankGate]
) -> None:
    _, running = gate
    tunnel = RankTunnel(f"127.0.0.1:{running.port}", RankTls(identities["worker"], "a"), max_connections=2)
    try:
        ours = [dist.TCPStore("127.0.0.1", tunnel.port, is_master=False, timeout=SHORT) for _ in range(2)]
        ours[0].set("worker/0", "hello")
        assert ours[1].get("worker/0") == b"hello"

        def refused() -> bool:
            try:
                socket.create_connection(("127.0.0.1", tunnel.port), timeout=2).close()
            except ConnectionRefusedError:
                return True
            return False

        wait_for(refused, 10, "the tunnel's port to close after the worker's two clients")
        with pytest.raises((RuntimeError, OSError)):  # a third client (a box on the worker's host)
            dist.TCPStore("127.0.0.1", tunnel.port, is_master=False, timeout=SHORT)
        assert ours[0].get("worker/0") == b"hello"  # the worker's own clients carry on
    finally:
        tunnel.close()


def _answer(port: int, context: ssl.SSLContext) -> bytes:
    """Connect with ``context`` and send bytes; what comes back before the gate hangs up (b"": nothing)."""
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
            context.wrap_socket(raw, server_hostname="trainer.a.nebula.internal") as tls,
        ):
            tls.sendall(b"\x00" * 64)
            return tls.recv(1024)
    except (ssl.SSLError, ConnectionError):
        return b""  # refused during or right after the handshake


def test_strangers_get_no_byte_of_the_store_and_each_refusal_is_logged(
    identities: dict[str, ServiceTlsFiles],
    gate: tuple[dist.TCPStore, RankGate],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="services.trainer.runtime.rank_gate")
    store, running = gate
    store.set("secret", "spec of someone")
    # A plain TCPStore client (what the unauthenticated port used to accept).
    with pytest.raises(Exception):  # noqa: B017  (torch raises its own store errors)
        dist.TCPStore("127.0.0.1", running.port, is_master=False, timeout=SHORT).get("secret")
    ca = str(identities["trainer"].ca)
    # TLS, but no client certificate.
    assert _answer(running.port, ssl.create_default_context(cafile=ca)) == b""
    # A certificate of this cluster that is not a worker's, and a worker of the other cluster.
    for name in ("data", "worker-b"):
        context = ssl.create_default_context(cafile=ca)
        context.load_cert_chain(str(identities[name].cert), str(identities[name].key))
        assert _answer(running.port, context) == b"", name
    assert store.num_keys() == 1  # the secret only: nothing of theirs was written

    def refusals() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage() == "rank store refused a connection"]

    # The plain client (torch retries it), the anonymous one, the data service's and b's worker.
    wait_for(lambda: len(refusals()) >= 4, 30, "every stranger's refusal to be logged", interval=0.1)


def test_a_worker_checks_it_reached_the_trainer(identities: dict[str, ServiceTlsFiles]) -> None:
    """A gate presenting another service's certificate (a spoofed address) gets no worker traffic."""
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=SHORT, wait_for_workers=False)
    impostor = RankGate("127.0.0.1:0", store.port, RankTls(identities["data"], "a"))
    tunnel = RankTunnel(f"127.0.0.1:{impostor.port}", RankTls(identities["worker"], "a"))
    try:
        with pytest.raises(Exception):  # noqa: B017
            dist.TCPStore("127.0.0.1", tunnel.port, is_master=False, timeout=SHORT).set("worker/0", "x")
        assert not store.check(["worker/0"])
    finally:
        tunnel.close()
        impostor.close()


def test_only_the_trainers_signature_on_exactly_this_stage_passes(
    identities: dict[str, ServiceTlsFiles],
) -> None:
    trainer, worker = identities["trainer"], identities["worker"]
    ca = trainer.ca.read_bytes()
    spec = b"the stage spec"
    signature, signer = sign_spec(trainer, 3, "alice", spec)
    verify_spec(ca, "a", 3, "alice", spec, signature, signer)
    for number, owner, body, why in (
        (3, "alice", b"another spec", "not signed"),
        (4, "alice", spec, "not signed"),  # replayed under the next number
        (3, "mallory", spec, "not signed"),
    ):
        with pytest.raises(RankAuthError, match=why):
            verify_spec(ca, "a", number, owner, body, signature, signer)
    forged, forger = sign_spec(worker, 3, "alice", spec)  # job code on a worker holds its key
    with pytest.raises(RankAuthError, match="not this cluster's trainer"):
        verify_spec(ca, "a", 3, "alice", spec, forged, forger)
    with pytest.raises(RankAuthError, match="not a certificate of this cluster's CA"):
        verify_spec(identities["worker-b"].ca.read_bytes(), "b", 3, "alice", spec, signature, signer)
    with pytest.raises(RankAuthError):
        verify_spec(ca, "a", 3, "alice", spec, b"", b"")  # unsigned


def test_worker_identities_are_issued_like_service_ones(pki_ab: PkiLayout, tmp_path: Path) -> None:
    files = issue_service_certificate(pki_ab.root, "a", "worker")
    assert files.dir.name == "worker" and files.key.stat().st_mode & 0o077 == 0
