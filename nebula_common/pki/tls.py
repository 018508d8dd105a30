"""gRPC credentials for the WAN port between cluster switches (mutual TLS, always).

The server side has no switch for turning client authentication off: on the WAN the client
certificate *is* the authentication, so a builder that could skip it would be a foot-gun. The
dialing side pins the peer's expected DNS name via ``grpc.ssl_target_name_override``, because the
address it dials (an IP, a load balancer) says nothing about which cluster should answer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from cryptography import x509

from nebula_common.pki.identity import Identity, identity_from_pem
from nebula_common.pki.store import ClusterPaths, PkiError

__all__ = [
    "KEEPALIVE_TIMEOUT_MS",
    "KEEPALIVE_TIME_MS",
    "channel_credentials",
    "channel_credentials_from_files",
    "channel_options",
    "peer_identity",
    "server_credentials",
    "server_credentials_from_files",
    "server_options",
]

#: Ping an idle WAN connection this often: NATs and firewalls commonly drop idle flows after 30-60 s.
KEEPALIVE_TIME_MS = 20_000
#: Declare the connection dead if a ping is not answered in this time, so calls fail over promptly.
KEEPALIVE_TIMEOUT_MS = 10_000

_PEM_CERT_KEY = "x509_pem_cert"


def _read(path: Path, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise PkiError(f"missing {what} {path}") from None
    if not data.strip():
        raise PkiError(f"{what} {path} is empty")
    return data


def _switch_material(cert: Path, key: Path, bundle: Path) -> tuple[bytes, bytes, bytes]:
    """(private key, certificate chain, trust bundle) of a switch, read fresh from disk."""
    return (
        _read(key, "switch private key"),
        _read(cert, "switch certificate"),
        _read(bundle, "trust bundle"),
    )


def server_credentials_from_files(cert: Path, key: Path, bundle: Path) -> grpc.ServerCredentials:
    """Credentials for the switch's WAN listener: present our leaf, demand a peer-CA-signed client cert.

    ``require_client_auth=True`` makes the TLS handshake itself fail for clients without a
    certificate chaining to the trust bundle, before any RPC handler runs. Takes plain paths
    because deployed switches get their files mounted (secrets), not a whole PKI layout.
    """
    key_pem, cert_pem, bundle_pem = _switch_material(cert, key, bundle)
    return grpc.ssl_server_credentials(
        [(key_pem, cert_pem)], root_certificates=bundle_pem, require_client_auth=True
    )


def channel_credentials_from_files(cert: Path, key: Path, bundle: Path) -> grpc.ChannelCredentials:
    """Credentials for dialing a peer switch: trust only peer CAs, authenticate with our switch leaf."""
    key_pem, cert_pem, bundle_pem = _switch_material(cert, key, bundle)
    return grpc.ssl_channel_credentials(
        root_certificates=bundle_pem, private_key=key_pem, certificate_chain=cert_pem
    )


def server_credentials(paths: ClusterPaths) -> grpc.ServerCredentials:
    """:func:`server_credentials_from_files` for a switch of a local PKI layout."""
    return server_credentials_from_files(paths.switch_cert, paths.switch_key, paths.trust_bundle)


def channel_credentials(paths: ClusterPaths) -> grpc.ChannelCredentials:
    """:func:`channel_credentials_from_files` for a switch of a local PKI layout."""
    return channel_credentials_from_files(paths.switch_cert, paths.switch_key, paths.trust_bundle)


def channel_options(peer: Identity) -> list[tuple[str, Any]]:
    """Channel arguments for dialing ``peer`` across the WAN.

    The target name override makes gRPC verify the server certificate's DNS SAN against
    ``peer.dns_name`` (and send it as SNI), so a valid certificate of a *different* trusted cluster
    is rejected. Keepalive pings run even without active calls so that a silently dropped WAN flow
    is noticed within about half a minute instead of at the next (failed) RPC.
    """
    return [
        ("grpc.ssl_target_name_override", peer.dns_name),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options() -> list[tuple[str, Any]]:
    """Server arguments that accept the client keepalive policy of :func:`channel_options`.

    By default a gRPC server treats pings more often than every 5 minutes on an idle connection as
    abuse and closes it with GOAWAY ``too_many_pings``; the WAN listener must tolerate 20 s pings.
    """
    return [
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
        ("grpc.http2.max_ping_strikes", 2),
    ]


def peer_identity(context: grpc.aio.ServicerContext | grpc.ServicerContext) -> Identity:
    """The identity of the authenticated caller of the current RPC.

    gRPC only exposes ``x509_pem_cert`` once the TLS handshake has verified the client certificate
    against the trust bundle, so reading it here is reading an authenticated fact. Anything else
    (plaintext, no client certificate, a certificate without a Nebula identity) is a
    ``PermissionError``: callers should treat it as unauthenticated, never fall back to a default.
    """
    auth = context.auth_context() or {}
    pems = auth.get(_PEM_CERT_KEY) or []
    if not pems:
        transport = b",".join(auth.get("transport_security_type", [])).decode(errors="replace") or "none"
        raise PermissionError(
            f"caller presented no verified client certificate (transport security: {transport}); "
            "the WAN port requires mutual TLS"
        )
    try:
        return identity_from_pem(pems[0])
    except ValueError as exc:
        raise PermissionError(
            f"caller's verified certificate carries no valid Nebula identity: {exc}"
        ) from exc


def peer_certificate(context: grpc.aio.ServicerContext | grpc.ServicerContext) -> x509.Certificate | None:
    """The verified client certificate of the current RPC, or None (none presented, unparsable)."""
    pems = (context.auth_context() or {}).get(_PEM_CERT_KEY) or []
    try:
        return x509.load_pem_x509_certificate(pems[0]) if pems else None
    except ValueError:
        return None
