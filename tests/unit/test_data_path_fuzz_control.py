"""Fuzzing the data path's parsers, part 2: the control messages around the byte streams.

Issue "One data plane", item 2 (part 1, ``test_data_path_fuzz.py``, has the helpers and the streams).
Whatever a peer sends, the outcome is a valid result or the parser's documented error, never another
exception or a hang:

* the sealed-records negotiation (``nebula_common/rpc/sealed_negotiation.py``): the ``NBSEAL2`` offer and
  answer -> a decision or SealedRecordError (the old ``NBSEAL1`` named), and both ends agree on the
  decision and, through the exporter, on the keys;
* the WAN port's first bytes (``services/switch/wan_frontend.py``, ``WanFrontend``): the raw preamble
  (``NBLINK1``/``NBLINK3``, echoed), anything else passed through to gRPC's TLS, or a refusal;
* link messages (``services/switch/link_handshake.py``: ``parse_link_message``) -> HandshakeError;
* the stage channel (``services/trainer/stage_channel.py``: ``receive``, ``parse_json``) -> ChannelError,
  or EOFError at the end; a length over ``MAX_MESSAGE_BYTES`` is refused before it is read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import event, example, given
from hypothesis import strategies as st
from OpenSSL import SSL

from nebula_common.proto.nebula.v1 import link_pb2
from nebula_common.rpc.sealed_negotiation import (
    MAGIC,
    NEGOTIATION,
    OLD_MAGIC,
    negotiate_acceptor,
    negotiate_dialer,
    parse_answer,
    parse_offer,
)
from nebula_common.rpc.sealed_records import HEADER, RecordSealing, SealedRecordError, sealed_size
from services.switch.link_handshake import HandshakeError, parse_link_message
from services.switch.rawlink_connection import OLD_PREAMBLES, PREAMBLE
from services.switch.wan_frontend import WanFrontend
from services.trainer import stage_channel as channel
from tests.unit.test_data_path_fuzz import MUTATIONS, STEP_S, field, fuzz, mutated, peak_while, run_bounded


# ----- the sealed-records negotiation (inside TLS) ----------------------------------------------
class ScriptedTls:
    """The verified pyOpenSSL connection of a negotiation, as a script: ``recv`` gives the peer's bytes in
    pieces of ``piece`` (then b"": it closed), ``send`` keeps what this side sent, the exporter is a
    function of the session (``session``) and its arguments, as TLS's is; ``sock`` is one end of a fresh
    socket pair, the TCP connection under TLS."""

    def __init__(
        self, incoming: bytes | Callable[[bytes], bytes], piece: int = 64, session: bytes = b"s"
    ) -> None:
        self.incoming, self.piece, self.sent, self.session = incoming, piece, b"", session
        self.sock, self.spare = socket.socketpair()

    def recv(self, size: int) -> bytes:
        if callable(self.incoming):  # the peer answers what it was sent
            self.incoming = self.incoming(self.sent)
        part, self.incoming = self.incoming[: min(size, self.piece)], self.incoming[min(size, self.piece) :]
        return part

    def send(self, data: bytes | memoryview) -> int:
        self.sent += bytes(data)
        return len(data)

    def pending(self) -> int:
        return 0

    def export_keying_material(self, label: bytes, olen: int, context: bytes | None = None) -> bytes:
        return HKDF(hashes.SHA256(), olen, salt=self.session, info=label + b"|" + (context or b"")).derive(
            b"k"
        )

    def close(self) -> None:
        self.sock.close()
        self.spare.close()


def _negotiate(side: Callable[..., Any], tls: ScriptedTls) -> tuple[object, RecordSealing]:
    try:
        return side(tls, tls.sock, time.monotonic() + STEP_S)  # type: ignore[no-any-return]
    finally:
        tls.close()


_VALID = st.builds(NEGOTIATION.pack, st.sampled_from([MAGIC, OLD_MAGIC]), st.integers(0, 255))
NEGOTIATIONS = st.one_of(
    st.binary(max_size=48), _VALID, st.tuples(_VALID, MUTATIONS).map(lambda m: mutated(*m))
)


def _decision(received: bytes) -> bytes | None:
    """The wish or decision byte of a well-formed offer or answer (None: not one)."""
    if len(received) < NEGOTIATION.size or received[: len(MAGIC)] != MAGIC:
        return None
    return received[len(MAGIC) : len(MAGIC) + 1]


@fuzz(300)
@given(message=NEGOTIATIONS, want=st.booleans())
@example(message=NEGOTIATION.pack(OLD_MAGIC, 1), want=True)
def test_negotiation_messages_parse_to_a_flag_or_a_sealed_record_error(message: bytes, want: bool) -> None:
    flag = _decision(message) if len(message) == NEGOTIATION.size else None
    for parse, acceptable in (
        (parse_offer, (b"\0", b"\1")),
        (lambda m: parse_answer(m, want), (b"\0", b"\1")[: 1 + want]),
    ):
        try:
            parsed = parse(message)
        except SealedRecordError as exc:
            assert flag not in acceptable
            if message[: len(OLD_MAGIC)] == OLD_MAGIC and len(message) == NEGOTIATION.size:
                assert "NBSEAL1" in str(exc) and "update the older switch" in str(exc)
        else:
            assert flag in acceptable and parsed == (flag == b"\1")


@fuzz(150)
@given(offer=NEGOTIATIONS, piece=st.integers(1, 64))
def test_an_acceptor_reads_any_offer_as_sealed_records_or_a_refusal(offer: bytes, piece: int) -> None:
    tls, wish = ScriptedTls(offer, piece), _decision(offer)
    try:
        _, sealing = _negotiate(negotiate_acceptor, tls)
    except SealedRecordError:
        assert wish != b"\1" or offer[: len(OLD_MAGIC)] == OLD_MAGIC
        if wish == b"\0" and offer[: len(MAGIC)] == MAGIC:  # a wish for TLS records: declined, told so
            assert _decision(tls.sent) == b"\0"
        return
    assert wish == b"\1" and sealing is not None and _decision(tls.sent) == b"\1"


@fuzz(150)
@given(answer=NEGOTIATIONS, piece=st.integers(1, 64))
def test_a_dialer_reads_any_answer_as_sealed_records_or_a_refusal(answer: bytes, piece: int) -> None:
    tls, decision = ScriptedTls(answer, piece), _decision(answer)
    try:
        _, sealing = _negotiate(negotiate_dialer, tls)
    except SealedRecordError:
        assert decision != b"\1" or answer[: len(OLD_MAGIC)] == OLD_MAGIC
        return
    assert decision == b"\1" and sealing is not None
    assert _decision(tls.sent) == b"\1"


def _opens(sender: RecordSealing, receiver: RecordSealing, message: bytes) -> bool:
    record = bytearray(sealed_size(len(message)))
    sender.seal_into(message, memoryview(record))
    opened = bytearray(len(message))
    try:
        receiver.open_into(record[: HEADER.size], memoryview(record)[HEADER.size :], memoryview(opened))
    except SealedRecordError:
        return False
    return opened == message


@fuzz(20)
@given(message=st.binary(max_size=64))
def test_both_ends_of_a_negotiation_agree_on_the_keys(message: bytes) -> None:
    accepting: list[RecordSealing] = []

    def acceptor(offer: bytes) -> bytes:
        tls = ScriptedTls(offer)
        accepting.append(_negotiate(negotiate_acceptor, tls)[1])
        return tls.sent

    _, dialer = _negotiate(negotiate_dialer, ScriptedTls(acceptor))
    acceptor_side = accepting[0]
    assert _opens(dialer, acceptor_side, message) and _opens(acceptor_side, dialer, message)
    # Reflected to its own sender (both counters at 1 now): the other direction's key refuses it.
    assert not _opens(dialer, dialer, message) and not _opens(acceptor_side, acceptor_side, message)


# ----- the WAN port's first bytes ---------------------------------------------------------------
class _Refusals:
    """The frontend's ``links`` as far as a connection's first bytes go: the layer of every refusal."""

    def __init__(self) -> None:
        self.layers: list[str] = []

    def refuse(self, layer: str, reason: str, **details: object) -> None:
        self.layers.append(layer)


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


CLIENT_HELLO = b"\x16\x03\x01\x00\xa5\x01"
"""The first bytes of a TLS ClientHello (a gRPC peer's connection)."""
FIRST_BYTES = st.one_of(
    st.binary(max_size=24),
    st.sampled_from([PREAMBLE, CLIENT_HELLO]),
    st.tuples(st.just(PREAMBLE), MUTATIONS).map(lambda m: mutated(*m)),
    st.binary(max_size=16).map(lambda b: b"N" + b),
    st.binary(max_size=16).map(lambda b: PREAMBLE + b),
    st.sampled_from(sorted(OLD_PREAMBLES)),  # an older switch's offer: refused (transport), never echoed
)


@fuzz(40)
@given(first=FIRST_BYTES)
@example(first=b"")
@example(first=PREAMBLE[:5])  # the peer left before its preamble was whole
def test_the_wan_port_sorts_any_first_bytes_into_records_tls_or_a_refusal(first: bytes) -> None:
    links, warnings, relayed = _Refusals(), _Warnings(), []  # relayed: the bytes each relay got
    frontend = WanFrontend(
        links,  # type: ignore[arg-type]
        "127.0.0.1:9",
        lambda: SSL.Context(SSL.TLS_METHOD),  # no certificate: every records TLS handshake fails
        handshake_timeout_s=STEP_S,
    )

    async def pass_through(conn: socket.socket) -> None:  # what the relay to gRPC's TLS would get
        conn.settimeout(STEP_S)
        relayed.append(b"".join(iter(lambda: conn.recv(64), b"")))
        conn.close()

    frontend._pass_through = pass_through  # type: ignore[method-assign]

    async def accepted() -> bytes:
        peer, ours = socket.socketpair()
        peer.settimeout(STEP_S)
        peer.sendall(first)
        peer.shutdown(socket.SHUT_WR)
        assert frontend.limits.admit("peer") is None  # as the accept loop does first
        await frontend._accepted(ours, "peer:1", "peer")
        echoed = b""
        with contextlib.suppress(ConnectionResetError):  # closed with bytes unread: a reset, after its reply
            while part := peer.recv(64):
                echoed += part
        peer.close()
        return echoed

    logger = logging.getLogger("services.switch.wan_frontend")
    logger.addHandler(warnings)
    try:
        echoed = run_bounded(accepted)
    finally:
        logger.removeHandler(warnings)
    assert not [m for m in warnings.messages if m.startswith("WAN connection from")], "an exception escaped"
    assert frontend.limits.held_by("peer") == 0, "the connection's slot was not given back"
    preamble, outcome = first[: len(PREAMBLE)], (links.layers, echoed, relayed)
    event(f"refused {links.layers}" if links.layers else "relayed" if relayed else "dropped")
    if not first or (first[:1] == PREAMBLE[:1] and len(first) < len(PREAMBLE)):
        assert outcome == ([], b"", [])  # nothing, or the start of a preamble, then the end: dropped
    elif first[:1] != PREAMBLE[:1]:
        assert outcome == ([], b"", [first])  # TLS or anything else: to gRPC's TLS, byte for byte
    elif preamble == PREAMBLE:
        # Echoed, then the TLS handshake fails (the frontend's TLS may say so: an alert record, 0x15).
        assert (links.layers, echoed[: len(PREAMBLE)], relayed) == (["tls"], preamble, [])
        assert echoed[len(PREAMBLE) : len(PREAMBLE) + 1] in (b"", b"\x15")
    else:
        assert outcome == (["transport"], b"", [])


# ----- link messages ---------------------------------------------------------------------------
def _nested(levels: int) -> bytes:
    """A LinkMessage whose routed item holds a framed item holding an item ... ``levels`` deep."""
    inner = b""
    for _ in range(levels):
        inner = field(0x4A, field(0x1A, inner))  # EdgeMessage.framed -> FramedItem.item
    return field(0x22, field(0x1A, inner))  # LinkMessage.routed -> RoutedItem.item


HELLOS = st.builds(
    lambda **fields: link_pb2.LinkMessage(hello=link_pb2.Handshake(**fields)).SerializeToString(),
    protocol_version=st.integers(0, 9),
    cluster_id=st.text(max_size=8),
    session_id=st.binary(max_size=8),
    raw_preamble=st.sampled_from([PREAMBLE, *sorted(OLD_PREAMBLES)]),
)


@fuzz(200)
@given(raw=st.one_of(st.binary(max_size=64), HELLOS, st.tuples(HELLOS, MUTATIONS).map(lambda m: mutated(*m))))
@example(raw=_nested(2000))
def test_link_messages_are_parsed_or_a_handshake_error(raw: bytes) -> None:
    for received in (raw, memoryview(raw)):
        try:
            message = parse_link_message(received)
        except HandshakeError:
            continue
        assert message == link_pb2.LinkMessage.FromString(raw)
    with pytest.raises(HandshakeError, match="unexpected object"):
        parse_link_message("not bytes")


# ----- the stage channel ------------------------------------------------------------------------
def channel_reads(stream: bytes) -> tuple[list[tuple[bytes, bytes]], BaseException]:
    """What the trainer's ``receive`` makes of ``stream`` from a stage process that then ended: the
    messages, then EOFError or the ChannelError."""
    ours, theirs = socket.socketpair()
    # A Connection reads with os.read, which no socket timeout bounds; the kernel's receive timeout does.
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(STEP_S), 0))
    theirs.sendall(stream)
    theirs.close()
    conn = Connection(ours.detach())
    got: list[tuple[bytes, bytes]] = []
    try:
        while True:
            try:
                got.append(channel.receive(conn))
            except (EOFError, channel.ChannelError) as exc:
                assert "temporarily unavailable" not in str(exc), "a read waited for its deadline: a hang"
                return got, exc
    finally:
        conn.close()


def sent_bytes(messages: list[tuple[bytes, bytes]]) -> bytes:
    """The bytes ``stage_channel.send`` puts on the socket for ``messages``."""
    ours, theirs = socket.socketpair()
    theirs.settimeout(STEP_S)
    writer = Connection(ours.detach())
    for kind, payload in messages:
        channel.send(writer, kind, payload)
    writer.close()
    data = b"".join(iter(lambda: theirs.recv(1 << 16), b""))
    theirs.close()
    return data


KINDS = st.sampled_from([channel.HELLO, channel.STATUS, channel.STEP, channel.EPOCH, channel.START])
CHANNEL_MESSAGES = st.lists(st.tuples(KINDS, st.binary(max_size=200)), max_size=4)


@fuzz(100)
@given(messages=CHANNEL_MESSAGES, mutations=st.one_of(st.just([]), MUTATIONS), raw=st.binary(max_size=32))
def test_the_stage_channel_reads_whole_messages_or_a_channel_error(
    messages: list[tuple[bytes, bytes]], mutations: list, raw: bytes
) -> None:
    stream = sent_bytes(messages)
    got, end = channel_reads(stream)
    assert got == messages and isinstance(end, EOFError)  # what the stage sent, whole, then its end
    for changed in (mutated(stream, mutations) if mutations else raw, raw):
        got, end = channel_reads(changed)  # only ChannelError or EOFError (checked there)
        assert all(len(kind) == 1 for kind, _ in got)


@pytest.mark.parametrize(
    "head",
    [
        struct.pack("!i", channel.MAX_MESSAGE_BYTES + 1),
        struct.pack("!i", (1 << 31) - 1),
        struct.pack("!i", -1) + struct.pack("!Q", (1 << 64) - 1),  # the 8-byte length of a big message
    ],
    ids=["over-limit", "2GiB", "16EiB"],
)
def test_a_stage_message_over_the_limit_is_refused_before_it_is_read(head: bytes) -> None:
    outcome: list[object] = []
    peak = peak_while(lambda: outcome.extend(channel_reads(head + b"x" * 64)))
    got, end = outcome
    assert got == [] and isinstance(end, channel.ChannelError) and "bad message length" in str(end)
    assert peak < 1 << 20


JSON = st.dictionaries(
    st.text(max_size=6),
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=6)),
    max_size=4,
)


@fuzz(300)
@given(body=JSON, mutations=st.one_of(st.just([]), MUTATIONS), raw=st.binary(max_size=32))
# json's C scanner recurses per level: RecursionError escaped ChannelError (the reader thread died of it).
@example(body={}, mutations=[], raw=b"[" * 100_000)
@example(body={}, mutations=[], raw=b'{"a":' * 100_000)
def test_stage_json_is_an_object_or_a_channel_error(
    body: dict[str, Any], mutations: list, raw: bytes
) -> None:
    kind, payload = channel_reads(sent_bytes([(channel.STEP, json.dumps(body).encode())]))[0][0]
    assert kind == channel.STEP and channel.parse_json(payload) == body  # the round trip
    for changed in (mutated(payload, mutations) if mutations else raw, raw):
        with contextlib.suppress(channel.ChannelError):
            assert isinstance(channel.parse_json(changed), dict)
