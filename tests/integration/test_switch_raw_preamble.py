"""Nothing of the records link is negotiable in clear: a rewritten preamble fails closed and is audited.

The records link's first bytes (``NBLINK3\\n``) cross the WAN before TLS. Which carrier runs is decided
inside the authenticated gRPC handshake (``Handshake.raw_link``), the record layer inside TLS, and the
acceptor confirms inside TLS the preamble the dialer sent (``Handshake.raw_preamble``). So a man in the
middle who rewrites the preamble gets no other carrier: the dialer refuses the connection (audited
``link.refused``, layer ``transport``), keeps dialing with records and never settles for a gRPC link;
once the path is honest again the records link comes up by itself. (That the acceptor refuses a hello
whose preamble differs from what it saw is ``test_switch_raw_link.py``'s "preamble differs" case.)
"""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path

import pytest

from nebula_common.pki import PkiLayout
from services.switch.rawlink_connection import PREAMBLE
from tests.integration.test_switch_data_plane import (  # noqa: F401  (clusters: a module fixture)
    Cluster,
    clusters,
    switch_pair,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

READ = 256 << 10
REWRITES = 3
"""Connections the proxy rewrites before it relays honestly: three refused raw attempts in a row."""


class PreambleRewriter:
    """A loopback TCP proxy in front of ``target_port``: the first ``REWRITES`` connections that open with
    ``PREAMBLE`` get ``replacement`` instead (dialer -> acceptor); all else is relayed byte for byte."""

    def __init__(self, target_port: int, replacement: bytes) -> None:
        self.target_port = target_port
        self.replacement = replacement
        self.rewritten = 0
        self.connections = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        threading.Thread(target=self._accept, name="preamble-rewriter", daemon=True).start()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _accept(self) -> None:
        while True:
            try:
                dialer, _ = self._listener.accept()
            except OSError:
                return
            try:
                acceptor = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
                acceptor.settimeout(None)
            except OSError:
                dialer.close()
                continue
            with self._lock:
                self.connections += 1
                self._sockets += [dialer, acceptor]
            threading.Thread(target=self._forward, args=(dialer, acceptor), daemon=True).start()
            threading.Thread(target=_relay, args=(acceptor, dialer), daemon=True).start()

    def _forward(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            first = b""
            while len(first) < len(PREAMBLE) and not first.startswith(b"\x16"):
                part = source.recv(len(PREAMBLE) - len(first))
                if not part:
                    break
                first += part
            if first == PREAMBLE:
                with self._lock:
                    if self.rewritten < REWRITES:
                        self.rewritten += 1
                        first = self.replacement
            sink.sendall(first)
            _relay(source, sink)
        except OSError:
            _close(source, sink)


def _relay(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(READ):
            sink.sendall(data)
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        _close(source, sink)


def _close(*sockets: socket.socket) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


@pytest.mark.parametrize(
    "replacement",
    [
        pytest.param(b"NBLINK1\n", id="tls-records-forged"),  # an older switch's offer: refused by name
        pytest.param(b"NBLINK2\n", id="old-sealed-offer"),  # the same
        pytest.param(b"XBLINK3\n", id="garbled"),  # neither preamble nor TLS: the acceptor passes it to gRPC
    ],
)
def test_a_rewritten_preamble_is_refused_and_never_moves_the_link_to_grpc(
    tmp_path: Path,
    pki_ab: PkiLayout,
    clusters: dict[str, Cluster],  # noqa: F811
    replacement: bytes,
) -> None:
    proxies: list[PreambleRewriter] = []

    def front(wan_port: int) -> int:
        proxies.append(PreambleRewriter(wan_port, replacement))
        return proxies[0].port

    try:
        # switch_pair returns once the link is up: after the proxy's rewrites, on the records carrier.
        with switch_pair(tmp_path, pki_ab, clusters, front=front) as pair:
            proxy = proxies[0]
            assert proxy.rewritten == REWRITES
            for switch in (pair.a, pair.b):
                assert switch.running.link.state.transport == "records"
            # The link's state is set just before its link.up record is written (on each switch's loop).
            ups = {}
            for c in ("a", "b"):
                records = wait_for(lambda c=c: pair.audit(c, "link.up"), 10, f"switch {c}'s link.up record")
                ups[c] = [r["details"]["transport"] for r in records]
            assert ups == {"a": ["records"], "b": ["records"]}, ups  # never a gRPC session in between
            wait_for(
                lambda: [
                    r
                    for r in pair.audit("a", "link.refused")
                    if r["details"]["layer"] == "transport" and "preamble" in r["details"]["reason"]
                ],
                10,
                "switch a's audited refusal of the rewritten preamble",
            )
    finally:
        for proxy in proxies:
            proxy.stop()
