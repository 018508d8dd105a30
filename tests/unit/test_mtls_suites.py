"""TLS strength of a real switch's WAN port, proven with ``openssl s_client`` (not with gRPC itself).

The switch runs in-process exactly as ``services.switch.server`` starts it (dynamic credentials,
cluster b accepting cluster a), next to a real auth service. Each case asks OpenSSL for one
protocol version or cipher suite and checks what the server agreed to:

* TLS 1.0 and 1.1 are refused (the client is allowed to offer them via ``@SECLEVEL=0``, so the
  refusal is the server's);
* TLS 1.2 with CBC (non-AEAD) suites is refused, although they match the ECDSA certificate;
* TLS 1.2 with suites that have no ephemeral ECDH is refused;
* what TLS 1.2 negotiates is ECDHE + AES-GCM or CHACHA20-POLY1305; TLS 1.3 works.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from nebula_common.pki import ClusterPaths, Identity, PkiLayout
from tests.support.accounts import auth_settings
from tests.support.servers import accepting_switch, running_auth

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl binary not installed"),
]
B_SWITCH = Identity("b", "switch")
AEAD_TLS12 = re.compile(r"^ECDHE-(ECDSA|RSA)-(AES(128|256)-GCM-SHA(256|384)|CHACHA20-POLY1305)$")
TLS13_SUITES = {"TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256"}


@dataclass(frozen=True)
class Handshake:
    """What one ``openssl s_client`` run agreed with the server."""

    returncode: int
    protocol: str
    cipher: str
    output: str

    @property
    def refused(self) -> bool:
        return self.returncode != 0 and self.cipher in ("(NONE)", "0000", "")


@pytest.fixture(scope="module")
def pki(pki_ab: PkiLayout) -> tuple[ClusterPaths, ClusterPaths]:
    return pki_ab.cluster("a"), pki_ab.cluster("b")


@pytest.fixture(scope="module")
def wan_port(
    tmp_path_factory: pytest.TempPathFactory, pki: tuple[ClusterPaths, ClusterPaths]
) -> Iterator[int]:
    work = tmp_path_factory.mktemp("switch-b")
    with (
        running_auth(auth_settings(work, "b")) as auth,
        accepting_switch(work, pki[1], "a", auth.address) as switch,
    ):
        yield switch.running.wan_port


def s_client(port: int, client: ClusterPaths, *args: str) -> Handshake:
    """One handshake as cluster a's switch (valid client certificate), then EOF."""
    openssl = shutil.which("openssl")
    assert openssl is not None
    # stdin=DEVNULL: s_client sends nothing and closes after the handshake.
    proc = subprocess.run(
        [
            openssl,
            "s_client",
            "-connect",
            f"127.0.0.1:{port}",
            "-servername",
            B_SWITCH.dns_name,
            "-verify_hostname",
            B_SWITCH.dns_name,
            "-CAfile",
            str(client.trust_bundle),
            "-cert",
            str(client.switch_cert),
            "-key",
            str(client.switch_key),
            "-alpn",
            "h2",
            "-verify_return_error",
            *args,
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        errors="replace",  # after the handshake the server's HTTP/2 frames are binary
        timeout=20,
        check=False,
    )
    output = proc.stdout + proc.stderr
    cipher = re.search(r"Cipher is (\S+)", output)
    protocol = re.search(r"^New, (\S+?),", output, re.MULTILINE)
    return Handshake(
        proc.returncode, protocol.group(1) if protocol else "", cipher.group(1) if cipher else "", output
    )


@pytest.mark.parametrize("version", ["-tls1", "-tls1_1"])
def test_tls_before_1_2_is_refused(
    wan_port: int, pki: tuple[ClusterPaths, ClusterPaths], version: str
) -> None:
    # @SECLEVEL=0 lets our OpenSSL offer TLS 1.0/1.1 at all; "no protocols available" would be ours.
    result = s_client(wan_port, pki[0], version, "-cipher", "DEFAULT:@SECLEVEL=0")
    assert "no protocols available" not in result.output, result.output
    assert result.refused, result.output


@pytest.mark.parametrize(
    "cipher",
    [
        "ECDHE-ECDSA-AES128-SHA256",  # ECDHE + ECDSA: fits the certificate, refused only for CBC
        "ECDHE-ECDSA-AES256-SHA384",
        "ECDHE-ECDSA-AES128-SHA",
        "AES128-SHA",  # static RSA key exchange, CBC
        "AES128-GCM-SHA256",  # static RSA key exchange (no forward secrecy) even with GCM
        "DHE-RSA-AES128-GCM-SHA256",  # finite-field DHE, not ECDHE
    ],
)
def test_tls_1_2_refuses_cbc_and_non_ecdhe_suites(
    wan_port: int, pki: tuple[ClusterPaths, ClusterPaths], cipher: str
) -> None:
    result = s_client(wan_port, pki[0], "-tls1_2", "-cipher", f"{cipher}:@SECLEVEL=0")
    assert "no cipher match" not in result.output, result.output  # our OpenSSL did offer it
    assert result.refused, result.output


def test_tls_1_2_negotiates_ecdhe_with_an_aead(wan_port: int, pki: tuple[ClusterPaths, ClusterPaths]) -> None:
    # Offer everything OpenSSL has, weakest allowed too: the server's choice is what counts.
    result = s_client(wan_port, pki[0], "-tls1_2", "-cipher", "ALL:@SECLEVEL=0")
    assert result.returncode == 0 and result.protocol == "TLSv1.2", result.output
    assert AEAD_TLS12.match(result.cipher), result.cipher
    assert "Verify return code: 0 (ok)" in result.output, result.output


def test_tls_1_3_works_with_an_aead(wan_port: int, pki: tuple[ClusterPaths, ClusterPaths]) -> None:
    result = s_client(wan_port, pki[0], "-tls1_3")
    assert result.returncode == 0 and result.protocol == "TLSv1.3", result.output
    assert result.cipher in TLS13_SUITES, result.cipher
    assert "Verify return code: 0 (ok)" in result.output, result.output


def test_handshake_without_a_client_certificate_is_refused(
    wan_port: int, pki: tuple[ClusterPaths, ClusterPaths]
) -> None:
    """Sanity check that the port under test is the mTLS WAN port, not some permissive listener."""
    a = pki[0]
    openssl = shutil.which("openssl")
    assert openssl is not None
    proc = subprocess.run(
        [openssl, "s_client", "-connect", f"127.0.0.1:{wan_port}", "-CAfile", str(a.trust_bundle), "-tls1_2"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        errors="replace",  # after the handshake the server's HTTP/2 frames are binary
        timeout=20,
        check=False,
    )
    assert proc.returncode != 0, proc.stdout
    # The server asked for a client certificate and aborted the handshake when none came.
    assert "Client Certificate Types" in proc.stdout, proc.stdout
    assert "unexpected eof" in proc.stderr or "alert" in proc.stderr, proc.stderr
