"""The records link carrier: the switch-to-switch session in sealed records after mutual TLS 1.3.

The gRPC link (``wan_servicer.py``, ``link.py``) carries each message as an HTTP/2 DATA frame of a
gRPC stream; every byte then passes gRPC's C core at both ends (a copy into and out of Python, HTTP/2
framing, its own TLS). The records carrier (``link_carrier=records``, the default) carries the SAME
messages -- serialized ``LinkMessage`` and framed chunks, byte for byte -- as AES-256-GCM records of at
most 1 MiB on the bare TCP connection, keyed from the TLS exporter of a mutual TLS 1.3 session
(``nebula_common/rpc/sealed_negotiation.py``, ``sealed_records.py``), so the session code
(``PeerLink.run_session`` / ``run_lane``: credits, acks, lanes, liveness, replay) is unchanged; only the
byte carrier differs.

Agreement (``Handshake.raw_link``). The dialer always starts on gRPC and, with the records carrier,
offers ``raw_link = 1`` in its handshake. An acceptor with the records carrier answers ``raw_link = 1``
and ends the call without starting a session; the dialer then connects with records to the SAME WAN
address. Two switches whose carriers differ refuse each other, each side auditing why (layer
``transport``): the choice is made inside TLS, and nothing sent in clear can change it; a records
connection that does not start is retried with records, never replaced by the gRPC link.

One port for both. Every switch owns its WAN port in Python (:class:`WanFrontend`, which also gives
each source address a few slots before its handshake completes: ``source_limits.py``) and keeps gRPC's
WAN server on a loopback port behind it. Each accepted connection starts either with the records
preamble (``NBLINK3\\n``, plaintext; the frontend answers with the same 8 bytes, then TLS starts) or
with a TLS record (a gRPC peer): the latter is passed through byte for byte to the gRPC server, whose
TLS still authenticates the peer end to end. So one address (and one shaped path through a WAN
emulator) serves the handshake that agrees on the carrier and both carriers.

Authentication is the gRPC link's: mutual TLS with this switch's certificate (hot-reloaded,
``CertificateManager.openssl_context``) against the same trust bundle; the dialer verifies the server
certificate's DNS name (the peer switch's), the acceptor requires a client certificate; then the
certificate must name exactly the configured peer switch (``PeerLink.check_identity``), not be revoked
(``PeerLink.is_revoked``), and the handshake must agree with it (``PeerLink.check_hello``). Every refusal
is counted and audited (``link.refused`` with the layer: tls, identity, revoked, handshake, transport).
The preamble crosses in clear, so each side confirms it inside TLS (``Handshake.raw_preamble``): a
preamble rewritten on path fails the connection (layer ``transport``) whatever it was rewritten to.

The parts, one module each: the connection the session runs on and the preambles
(``rawlink_connection.py``, on ``nebula_common/rpc/raw_records.py``), the dialer's set-up
(``rawlink_dialer.py``), the WAN port that accepts records connections and passes gRPC ones through
(``wan_frontend.py``), and the acceptor's checks before a session (``rawlink_acceptor.py``). Their
names stay importable from here.
"""

from __future__ import annotations

from nebula_common.rpc.raw_record_bounds import MAX_MESSAGE_BYTES
from services.switch.link_handshake import RAW_LINK_VERSION
from services.switch.rawlink_acceptor import serve_raw
from services.switch.rawlink_connection import PREAMBLE, RawConnection, Secured
from services.switch.rawlink_dialer import dial_raw
from services.switch.wan_frontend import MAX_RAW_HANDSHAKES, WanFrontend

__all__ = [
    "MAX_MESSAGE_BYTES",
    "MAX_RAW_HANDSHAKES",
    "PREAMBLE",
    "RAW_LINK_VERSION",
    "RawConnection",
    "Secured",
    "WanFrontend",
    "dial_raw",
    "serve_raw",
]
