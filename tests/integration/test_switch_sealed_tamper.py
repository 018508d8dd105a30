"""Sealed link records (nebula_common/rpc/sealed_records.py) against a man in the middle, two real switches.

Both switches run the records link carrier (the default); a TCP proxy of this module sits in front
of switch b's WAN port and forwards every byte faithfully, except on the FIRST raw connection that opens
with the sealed preamble (``NBLINK3\\n``). There it follows the dialer's (a -> b) stream record by record
-- TLS records (type 0x14-0x17, ``type version length`` headers) until the first sealed record (kind 1,
2 or 3, ``>BII`` header: a sealed header can never be taken for a TLS one) -- and, once the first sealed
record of a few KiB passes (the first 1 MiB part of the framed chunk a trainer at a sends to one at b),
either

* flips one bit of its ciphertext: switch b must end the link session, audit ``link.down`` with a reason
  naming the failed authentication, and tell its attached trainer; no wrong byte may ever reach the
  receiving trainer (the record is authenticated whole before any of it is handed on); or
* ends the connection right after it (a TCP end without the sealed CLOSE): switch b must report a cut
  (the reason names the missing sealed close), not a clean end of the session.

Either way the dialer reconnects (through the same proxy, forwarding faithfully now), the link comes back
as ``records`` and a chunk sent afterwards crosses byte for byte. Pinned because the sealed design
rests on exactly these claims (tampering and truncation are detected, reported, and recovered from like
any lost connection), and only a real path between real switches shows the whole chain holds.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import pytest

from nebula_common.pki import PkiLayout
from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.rpc.framing import encode_chunk
from nebula_common.rpc.sealed_records import CLOSE, HEADER, LAST, PART, TAG_BYTES
from services.switch.rawlink_connection import PREAMBLE
from tests.integration.test_switch_data_plane import (  # noqa: F401  (clusters: a module fixture)
    Cluster,
    EdgeClient,
    Pair,
    clusters,
    frame,
    switch_pair,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SEALED: dict[str, str] = {}  # the records carrier is the default
BIG_RECORD = 4096
"""Plaintext bytes from which a sealed record is the one the proxy acts on (the chunk, not a ping)."""
PAYLOAD = bytes(range(256)) * 4096  # 1 MiB
TLS_TYPES = (0x14, 0x15, 0x16, 0x17)  # change_cipher_spec, alert, handshake, application_data
TLS_HEADER = 5
READ = 256 << 10
Action = Literal["flip", "cut"]


class _Stream:
    """Follows the dialer's bytes of one sealed raw connection: preamble, TLS records, sealed records.

    ``feed`` returns the bytes to forward (one bit flipped, with ``flip``) and whether to end the
    connection there (``cut``: right after the first big sealed record, nothing of what follows).
    """

    def __init__(self, proxy: TamperingProxy) -> None:
        self.proxy = proxy
        self.head = bytearray()
        self.need = len(PREAMBLE)
        self.preamble = True
        self.body = 0  # bytes of the current record's body still to pass
        self.flip_at: int | None = None  # offset in the remaining body of the bit to flip
        self.cut_after = False  # the current record is the one after which the connection ends
        self.sealed = False
        self.tls_records = 0
        self.sealed_records = 0
        self.broken = False  # the stream did not parse: forwarded untouched from there on

    def _header(self) -> None:
        head = bytes(self.head)
        self.head.clear()
        if self.preamble:
            self.preamble = False
            self.need = TLS_HEADER
            if head != PREAMBLE:
                self._broken(f"preamble {head!r}")
            return
        if not self.sealed and head[0] in TLS_TYPES:
            self.tls_records += 1
            self.body = int.from_bytes(head[3:5], "big")
            return
        if len(head) < HEADER.size:  # not TLS: the rest of a sealed header first
            self.head += head
            self.need = HEADER.size
            return
        kind, length, _ = HEADER.unpack(head)
        if kind not in (PART, LAST, CLOSE):
            self._broken(f"header {head.hex()} after {self.tls_records} TLS / {self.sealed_records} sealed")
            return
        self.sealed = True
        self.need = HEADER.size
        self.sealed_records += 1
        self.body = length + TAG_BYTES
        if kind != CLOSE and length >= BIG_RECORD and not self.proxy.acted.is_set():
            if self.proxy.action == "flip":
                self.flip_at = length // 2  # inside the ciphertext, well before the tag
            else:
                self.cut_after = True

    def _broken(self, what: str) -> None:
        self.broken = True
        self.proxy.problems.append(f"the dialer's stream did not parse as expected: {what}")

    def feed(self, data: bytes) -> tuple[bytes, bool]:
        if self.broken:
            return data, False
        out = bytearray(data)
        i = 0
        while i < len(out) and not self.broken:
            if self.body:
                n = min(self.body, len(out) - i)
                if self.flip_at is not None:
                    if self.flip_at < n:
                        out[i + self.flip_at] ^= 0x10
                        self.flip_at = None
                        self.proxy.acted.set()
                    else:
                        self.flip_at -= n
                self.body -= n
                i += n
                if not self.body and self.cut_after:
                    self.cut_after = False
                    self.proxy.acted.set()
                    return bytes(out[:i]), True
                continue
            take = min(self.need - len(self.head), len(out) - i)
            self.head += out[i : i + take]
            i += take
            if len(self.head) == self.need:
                self._header()
        return bytes(out), False


class TamperingProxy:
    """A loopback TCP proxy in front of ``target_port`` (threads, blocking sockets).

    Every connection is relayed both ways byte for byte, except the first one that opens with the
    sealed preamble: on it the proxy does ``action`` once (see ``_Stream``). ``acted`` is set then;
    ``sealed_connections`` counts the connections that opened with the sealed preamble.
    """

    def __init__(self, target_port: int, action: Action) -> None:
        self.target_port = target_port
        self.action = action
        self.acted = threading.Event()
        self.problems: list[str] = []
        self.sealed_connections = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        threading.Thread(target=self._accept, name="tampering-proxy", daemon=True).start()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the pumps; each closes its own sockets

    def _accept(self) -> None:
        while True:
            try:
                dialer, _ = self._listener.accept()
            except OSError:
                return
            try:
                acceptor = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
                acceptor.settimeout(None)
            except OSError as exc:
                self.problems.append(f"cannot reach switch b's WAN port: {exc}")
                dialer.close()
                continue
            for sock in (dialer, acceptor):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets += [dialer, acceptor]
            done = threading.Barrier(2, action=lambda d=dialer, a=acceptor: (d.close(), a.close()))
            threading.Thread(target=self._forward, args=(dialer, acceptor, done), daemon=True).start()
            threading.Thread(target=self._backward, args=(acceptor, dialer, done), daemon=True).start()

    def _claim(self, first: bytes) -> _Stream | None:
        """The stream follower for a connection whose first bytes are ``first`` (None: relay as is)."""
        if not first.startswith(PREAMBLE):
            return None
        with self._lock:
            self.sealed_connections += 1
            return _Stream(self) if self.sealed_connections == 1 else None

    def _forward(self, source: socket.socket, sink: socket.socket, done: threading.Barrier) -> None:
        """Dialer -> acceptor, where the proxy acts."""
        try:
            first = b""
            while len(first) < len(PREAMBLE) and not first.startswith(b"\x16"):
                part = source.recv(len(PREAMBLE) - len(first))
                if not part:
                    break
                first += part
            stream = self._claim(first)
            data = first
            while data:
                cut = False
                if stream is not None:
                    data, cut = stream.feed(data)
                sink.sendall(data)
                if cut:  # the connection ends here for the acceptor: the rest of the dialer's is dropped
                    sink.shutdown(socket.SHUT_WR)
                    while source.recv(READ):
                        pass
                    break
                data = source.recv(READ)
            else:
                sink.shutdown(socket.SHUT_WR)
        except OSError:
            _abort(source, sink)
        finally:
            _leave(done)

    def _backward(self, source: socket.socket, sink: socket.socket, done: threading.Barrier) -> None:
        """Acceptor -> dialer, relayed as is."""
        try:
            while data := source.recv(READ):
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            _abort(source, sink)
        finally:
            _leave(done)


def _abort(*sockets: socket.socket) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _leave(done: threading.Barrier) -> None:
    with contextlib.suppress(threading.BrokenBarrierError):
        done.wait(timeout=60)


@contextmanager
def proxied_pair(
    tmp_path: Path, pki: PkiLayout, accounts: dict[str, Cluster], action: Action
) -> Iterator[tuple[Pair, TamperingProxy]]:
    """Switch b accepting, switch a dialing it through a ``TamperingProxy`` (``switch_pair``'s
    ``front``), both with sealed raw link records."""
    proxies: list[TamperingProxy] = []

    def front(wan_port: int) -> int:
        proxies.append(TamperingProxy(wan_port, action))
        return proxies[0].port

    try:
        with switch_pair(tmp_path, pki, accounts, front=front, **SEALED) as pair:
            yield pair, proxies[0]
    finally:
        for proxy in proxies:
            proxy.stop()


def _received(end: EdgeClient) -> list[relay_pb2.EdgeMessage | bytes]:
    """What ``end`` has received so far (without waiting)."""
    items: list[relay_pb2.EdgeMessage | bytes] = []
    while not end.inbox.empty():
        message = end.next(0, "a message already received")
        assert message is not None and not isinstance(message, BaseException), f"stream ended: {message!r}"
        items.append(message)
    return items


def _wrong_chunks(items: list[relay_pb2.EdgeMessage | bytes], expected: bytes) -> list[str]:
    return [f"{len(item)} bytes" for item in items if isinstance(item, bytes) and item != expected]


def _the_link_breaks_and_recovers(
    tmp_path: Path, pki: PkiLayout, accounts: dict[str, Cluster], action: Action, named: str
) -> None:
    with proxied_pair(tmp_path, pki, accounts, action) as (pair, proxy):
        # The link's state is set just before its link.up record is written (on the switch's own loop).
        ups = [r["details"] for r in wait_for(lambda: pair.audit("b", "link.up"), 10, "b's link.up record")]
        assert [up["transport"] for up in ups] == ["records"], ups
        # The session's first connection (the one the proxy acts on) and its express connection.
        wait_for(lambda: proxy.sealed_connections == 2, 10, "the session's two connections")
        sender = EdgeClient(pair.a, accounts["a"].tokens["alice"], f"{action}-before")
        receiver = EdgeClient(pair.b, accounts["b"].tokens["alice"], f"{action}-before")
        for end in (sender, receiver):
            end.expect("ready")
        raw, _ = encode_chunk(f"{action}-before", "e", 0, 1, 0, PAYLOAD, True)
        sender.send(frame(1))
        sender.send(raw)
        assert proxy.acted.wait(30), f"the proxy never saw the chunk's sealed record: {proxy.problems}"
        assert not proxy.problems, proxy.problems

        # Switch b ends the session, says why, and tells the attached trainer.
        downs = wait_for(lambda: pair.audit("b", "link.down"), 30, "switch b to audit link.down")
        reason = downs[0]["details"]["reason"]
        assert named in reason, downs
        seen: list[relay_pb2.EdgeMessage | bytes] = []

        def told(up: bool) -> relay_pb2.LinkNotice | None:
            seen.extend(_received(receiver))
            messages = [m for m in seen if isinstance(m, relay_pb2.EdgeMessage)]
            return next((m.notice for m in messages if m.HasField("notice") and m.notice.up == up), None)

        notice = wait_for(lambda: told(False), 30, "the receiving trainer to be told the link is down")
        assert named in notice.reason, notice

        # The dialer reconnects through the (now faithful) proxy, sealed again.
        wait_for(lambda: len(pair.audit("b", "link.up")) >= 2, 30, "switch b to audit the link up again")
        ups = [r["details"] for r in pair.audit("b", "link.up")]
        assert ups[-1]["transport"] == "records", ups
        assert proxy.sealed_connections >= 3, proxy.sealed_connections
        wait_for(lambda: pair.a.running.link.connected and pair.b.running.link.connected, 30, "the link up")
        assert pair.a.running.link.state.transport == "records"
        wait_for(lambda: told(True), 30, "the receiving trainer to be told the link is up again")
        assert pair.audit("a", "link.down"), "switch a audited no link.down"

        # A chunk sent now crosses byte for byte.
        job = f"{action}-after"
        after_sender = EdgeClient(pair.a, accounts["a"].tokens["bob"], job)
        after_receiver = EdgeClient(pair.b, accounts["b"].tokens["bob"], job)
        for end in (after_sender, after_receiver):
            end.expect("ready")
        after, _ = encode_chunk(job, "e", 0, 1, 0, PAYLOAD[::-1], True)
        after_sender.send(frame(1))
        after_sender.send(after)
        after_receiver.expect("frame")
        assert after_receiver.expect_framed() == after

        # Nothing but the very bytes sent ever reached the first receiver (most likely nothing at all).
        seen.extend(_received(receiver))
        assert not _wrong_chunks(seen, raw), _wrong_chunks(seen, raw)
        assert not proxy.problems, proxy.problems
        for end in (sender, receiver, after_sender, after_receiver):
            end.finish()


def test_a_tampered_sealed_record_ends_the_link_with_an_audited_reason_and_the_link_recovers(
    tmp_path: Path,
    pki_ab: PkiLayout,
    clusters: dict[str, Cluster],  # noqa: F811
) -> None:
    _the_link_breaks_and_recovers(tmp_path, pki_ab, clusters, "flip", "failed authentication")


def test_a_sealed_connection_cut_after_a_whole_record_is_reported_as_a_cut_and_the_link_recovers(
    tmp_path: Path,
    pki_ab: PkiLayout,
    clusters: dict[str, Cluster],  # noqa: F811
) -> None:
    _the_link_breaks_and_recovers(tmp_path, pki_ab, clusters, "cut", "without its sealed close: cut")
