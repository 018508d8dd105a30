"""The sealed-records handshake (pyOpenSSL, ``exporter_tls.py``) accepts and refuses what ``ssl`` does.

A raw link connection that offers sealed records runs its mutual TLS 1.3 handshake through pyOpenSSL
(for the TLS exporter) instead of Python's ``ssl``. Both are built from the same files: ``ssl``'s as the
switch builds its raw-link contexts (``tests/support/raw_tls.py``), pyOpenSSL's through
``openssl_context``. Each case here puts one side of ours -- once with ``ssl``, once with pyOpenSSL --
against the same peer (always ``ssl``), genuine or not: a certificate of another CA, none at all, an
expired or not yet valid one, one for another name, TLS 1.2 only. Our side must accept or refuse
alike with both; a refusal by pyOpenSSL names OpenSSL's reason. (Revocation and the peer's identity
are checked after either handshake on the same certificate: ``test_switch_sealed_identity.py``.)
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from nebula_common.pki import Identity, create_ca, issue_certificate
from nebula_common.rpc.exporter_tls import TlsHandshakeError, handshake
from tests.support.raw_tls import (
    client_context,
    openssl_client_context,
    openssl_server_context,
    server_context,
)

STEP_S = 10.0
SERVER = Identity("a", "switch")
CLIENT = Identity("a", "trainer")  # a's CA is name-constrained to cluster a (both sides check it)


class Pki:
    """Two CAs (``a`` trusted, ``rogue`` not) and PEM files of the leaves a case needs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca, self.ca_key = create_ca("a")
        self.rogue, self.rogue_key = create_ca("a")
        self.bundle = self._write("bundle.pem", self.ca.public_bytes(serialization.Encoding.PEM))

    def _write(self, name: str, data: bytes) -> str:
        path = self.root / name
        path.write_bytes(data)
        return str(path)

    def leaf(
        self, name: str, identity: Identity, *, rogue: bool = False, **validity: object
    ) -> tuple[str, str]:
        ca, key = (self.rogue, self.rogue_key) if rogue else (self.ca, self.ca_key)
        cert, leaf_key = issue_certificate(ca, key, identity, **validity)  # type: ignore[arg-type]
        return (
            self._write(f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM)),
            self._write(
                f"{name}.key",
                leaf_key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                ),
            ),
        )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("sealed-identity"))


def _pair(ours: Callable[[socket.socket], object], peer: Callable[[socket.socket], object]) -> object:
    """Run our side and the peer's on a socket pair; our side's result or exception."""
    left, right = socket.socketpair()
    results: list[object] = [None, None]

    def run(index: int, side: Callable[[socket.socket], object], sock: socket.socket) -> None:
        try:
            results[index] = side(sock)
        except BaseException as exc:
            results[index] = exc
        finally:
            if isinstance(results[index], BaseException):
                sock.close()  # a refusing side ends the connection: the other does not wait

    threads = [
        threading.Thread(target=run, args=(0, ours, left), daemon=True),
        threading.Thread(target=run, args=(1, peer, right), daemon=True),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(STEP_S)
        assert not thread.is_alive(), "a handshake still runs: a hang"
    for sock in (left, right):
        sock.close()
    return results[0]


def _ssl_peer(context: ssl.SSLContext, server_side: bool) -> Callable[[socket.socket], object]:
    def side(sock: socket.socket) -> object:
        sock.settimeout(STEP_S)
        tls = context.wrap_socket(
            sock, server_side=server_side, server_hostname=None if server_side else SERVER.dns_name
        )
        with contextlib.suppress(OSError):
            tls.recv(1)  # TLS 1.3: a client learns of the server's refusal of its certificate here
        return tls

    return side


def _ours(
    implementation: str, files: tuple[str, str], bundle: str, server_side: bool, name: str
) -> Callable[[socket.socket], object]:
    cert, key = files
    if implementation == "ssl":
        context = (server_context if server_side else client_context)(cert, key, bundle)

        def with_ssl(sock: socket.socket) -> object:
            sock.settimeout(STEP_S)
            tls = context.wrap_socket(
                sock, server_side=server_side, server_hostname=None if server_side else name
            )
            cert = tls.getpeercert(binary_form=True)
            tls.close()  # the peer, waiting for a refusal, sees the end instead
            assert cert, "no peer certificate"
            return "accepted"

        return with_ssl
    openssl = (openssl_server_context if server_side else openssl_client_context)(cert, key, bundle)

    def with_openssl(sock: socket.socket) -> object:
        handshake(
            sock, openssl, server_name=None if server_side else name, deadline=time.monotonic() + STEP_S
        )
        sock.close()  # the peer, waiting for a refusal, sees the end instead
        return "accepted"

    return with_openssl


def _outcome(result: object) -> str:
    if result == "accepted":
        return "accepted"
    assert isinstance(result, (ssl.SSLError, TlsHandshakeError, OSError)), repr(result)
    return "refused"


NOW = datetime.now(UTC)
CASES = {
    # name: (our side is the server?, the peer's certificate spec, the name our client expects, outcome)
    "genuine client": (True, {}, SERVER.dns_name, "accepted"),
    "client of another CA": (True, {"rogue": True}, SERVER.dns_name, "refused"),
    "client without a certificate": (True, None, SERVER.dns_name, "refused"),
    "expired client": (
        True,
        {"not_before": NOW - timedelta(days=2), "validity": timedelta(days=1)},
        SERVER.dns_name,
        "refused",
    ),
    "genuine server": (False, {}, SERVER.dns_name, "accepted"),
    "server of another CA": (False, {"rogue": True}, SERVER.dns_name, "refused"),
    "server for another name": (False, {}, Identity("a", "auth").dns_name, "refused"),
    "server not yet valid": (
        False,
        {"not_before": NOW + timedelta(days=1), "validity": timedelta(days=1)},
        SERVER.dns_name,
        "refused",
    ),
    "TLS 1.2 client": (True, {"tls12": True}, SERVER.dns_name, "refused"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_sealed_handshake_accepts_and_refuses_exactly_what_the_ssl_handshake_does(
    pki: Pki, case: str
) -> None:
    server_side, spec, name, expected = CASES[case]
    ours_files = pki.leaf(f"ours-{server_side}", SERVER if server_side else CLIENT)
    peer_identity = CLIENT if server_side else SERVER
    spec = dict(spec) if spec is not None else None
    tls12 = bool(spec and spec.pop("tls12", False))
    outcomes = {}
    reasons = {}
    for implementation in ("ssl", "pyopenssl"):
        if spec is None:
            peer = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            peer.load_verify_locations(pki.bundle)
        else:
            cert, key = pki.leaf(f"peer-{case}", peer_identity, **spec)
            peer = (client_context if server_side else server_context)(cert, key, pki.bundle)
        if tls12:
            peer.minimum_version = ssl.TLSVersion.TLSv1_2
            peer.maximum_version = ssl.TLSVersion.TLSv1_2
        result = _pair(
            _ours(implementation, ours_files, pki.bundle, server_side, name), _ssl_peer(peer, not server_side)
        )
        outcomes[implementation] = _outcome(result)
        reasons[implementation] = str(result)
    assert outcomes == {"ssl": expected, "pyopenssl": expected}, reasons
    if "expired" in case or "not yet valid" in case:
        assert "certificate has expired" in reasons["pyopenssl"] or "not yet valid" in reasons["pyopenssl"]


def test_the_name_check_follows_rfc_6125_for_names_wildcards_and_addresses() -> None:
    """``name_matches`` is PyCA's ``service-identity``: a wildcard covers one whole label, an address only
    an IP entry, and a certificate without subject alternative names matches nothing."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from nebula_common.rpc.exporter_tls import name_matches

    key = ec.generate_private_key(ec.SECP256R1())

    def cert(names: list[x509.GeneralName] | None) -> x509.Certificate:
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "switch.b.example")])
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(1)
            .not_valid_before(NOW - timedelta(days=1))
            .not_valid_after(NOW + timedelta(days=1))
        )
        if names is not None:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(key, hashes.SHA256())

    sans = cert(
        [
            x509.DNSName("switch.b.example"),
            x509.DNSName("*.wild.example"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        ]
    )
    for name in ("switch.b.example", "SWITCH.b.example.", "x.wild.example", "127.0.0.1"):
        assert name_matches(sans, name), name
    for name in ("other.example", "a.b.wild.example", "wild.example", "127.0.0.2", "::1", ""):
        assert not name_matches(sans, name), name
    assert not name_matches(cert(None), "switch.b.example")  # the common name alone is not enough
