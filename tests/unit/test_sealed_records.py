"""Sealed records (``sealed_records.py``, ``sealed_receive.py``, ``sealed_negotiation.py``): the security
properties, pinned on real bytes.

A sealed connection drops TLS's own records after the mutual TLS 1.3 handshake and carries each message
as AES-256-GCM records of at most 1 MiB, keyed from the TLS exporter, so everything TLS used to
guarantee on the data path -- that a changed, replayed, reordered, dropped, reflected or truncated byte
stream is refused, never delivered -- now rests on these modules and on ``RawConnection``'s sealed path
(``nebula_common/rpc/raw_io_thread.py``). These tests pin those guarantees where they would break:

* ``RecordSealing`` and ``SealedReceiver`` alone (no sockets): round trips of every size (in several
  records too), RFC 8446 nonces (secret IV XOR record number), the key update after ``limit_bytes``
  or ``limit_records``, and that every single flipped bit, every reordering and every direction
  confusion is refused.
* The negotiation over real mutual TLS 1.3 (pyOpenSSL, real certificates of a local PKI): who gets
  sealed records and who keeps TLS, both ends export the same keys (and another connection others),
  and a broken or hostile peer is an error (never a hang).
* A man in the middle on loopback TCP between two sealed ``RawConnection``: after the handshake and the
  negotiation pass through it untouched, it attacks the sealed dialer -> acceptor stream; the acceptor
  must deliver exactly the messages before the attack, unchanged, then fail -- never a wrong message.
* A large sealed message is decrypted straight into a buffer of its own (``views=True``).

Identity refusals on the sealed handshake, side by side with ``ssl``'s: ``test_sealed_identity.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand
from OpenSSL import SSL

from nebula_common.pki import init_pki
from nebula_common.pki.service_identity import ServiceTlsFiles, ensure_service_certificates, service_tls_dir
from nebula_common.rpc.blocking_steps import in_thread
from nebula_common.rpc.exporter_tls import handshake, recv_exact, send_all
from nebula_common.rpc.internal_tls import server_name
from nebula_common.rpc.raw_record_bounds import END
from nebula_common.rpc.raw_records import RawConnection, RawConnectionError
from nebula_common.rpc.sealed_negotiation import (
    EXPORTER_LABEL,
    MAGIC,
    NEGOTIATION,
    OLD_MAGIC,
    negotiate_acceptor,
    negotiate_dialer,
)
from nebula_common.rpc.sealed_receive import SealedReceiver
from nebula_common.rpc.sealed_records import (
    CLOSE,
    HEADER,
    LAST,
    MAX_RECORD_BYTES,
    PART,
    TAG_BYTES,
    RecordSealing,
    SealedRecordError,
    sealed_size,
)
from tests.support.raw_tls import openssl_client_context, openssl_server_context

T = TypeVar("T")
U = TypeVar("U")

DEADLINE_S = 30.0
"""Bound of one async test body (each takes well under a second)."""
STEP_S = 10.0
"""Bound of one awaited step (a read, a handshake): a hang fails with the step's name."""
IO_TIMEOUT_S = 5.0
"""Deadline of a blocking TLS step: a negotiation error must come well before it (then it is not a hang)."""
NAME = server_name("switch", "a")


# ----- real certificates, real TLS ------------------------------------------------------------------
@pytest.fixture(scope="module")
def identities(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ServiceTlsFiles]:
    root = tmp_path_factory.mktemp("pki")
    init_pki(root, ["a", "b"])  # a PKI has two clusters at least
    ensure_service_certificates(root, "a")
    return {
        f"{service}-a": ServiceTlsFiles.in_dir(service_tls_dir(root, "a", service))
        for service in ("switch", "trainer")
    }


def _server(identities: dict[str, ServiceTlsFiles]) -> SSL.Context:
    files = identities["switch-a"]
    return openssl_server_context(str(files.cert), str(files.key), str(files.ca))


def _client(identities: dict[str, ServiceTlsFiles]) -> SSL.Context:
    files = identities["trainer-a"]
    return openssl_client_context(str(files.cert), str(files.key), str(files.ca))


def _concurrently(
    dialer: Callable[[], T], acceptor: Callable[[], U]
) -> tuple[T | BaseException, U | BaseException]:
    """Run the two blocking sides on threads of their own; each one's result or exception."""
    results: list[object] = [None, None]

    def run(index: int, side: Callable[[], object]) -> None:
        try:
            results[index] = side()
        except BaseException as exc:
            results[index] = exc

    threads = [
        threading.Thread(target=run, args=(index, side), name=name, daemon=True)
        for index, (side, name) in enumerate([(dialer, "test-dialer"), (acceptor, "test-acceptor")])
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(STEP_S)
        if thread.is_alive():
            pytest.fail(f"the {thread.name} side is still blocked after {STEP_S} s: a hang")
    return results[0], results[1]  # type: ignore[return-value]


class Tls:
    """One end of a pyOpenSSL TLS 1.3 connection right after its handshake, with blocking steps."""

    def __init__(self, conn: SSL.Connection, sock: socket.socket) -> None:
        self.conn, self.sock = conn, sock

    def sendall(self, data: bytes) -> None:
        send_all(self.conn, self.sock, data, time.monotonic() + IO_TIMEOUT_S)

    def recv_exact(self, size: int) -> bytes:
        return recv_exact(self.conn, self.sock, size, time.monotonic() + IO_TIMEOUT_S)

    def negotiate(self, dialer: bool) -> tuple[object, RecordSealing]:
        side = negotiate_dialer if dialer else negotiate_acceptor
        return side(self.conn, self.sock, time.monotonic() + IO_TIMEOUT_S)

    def close(self) -> None:
        self.sock.close()


def _handshaken(identities: dict[str, ServiceTlsFiles]) -> tuple[Tls, Tls]:
    """(dialer, acceptor) on a socket pair, right after the mutual TLS 1.3 handshake."""
    left, right = socket.socketpair()
    client, server = _client(identities), _server(identities)
    deadline = time.monotonic() + IO_TIMEOUT_S
    dialer, acceptor = _concurrently(
        lambda: handshake(left, client, server_name=NAME, deadline=deadline),
        lambda: handshake(right, server, server_name=None, deadline=deadline),
    )
    for side in (dialer, acceptor):
        if isinstance(side, BaseException):
            raise side
    assert not isinstance(dialer, BaseException) and not isinstance(acceptor, BaseException)
    assert dialer[0].get_protocol_version_name() == "TLSv1.3"
    return Tls(dialer[0], left), Tls(acceptor[0], right)


def _run(body: Callable[[], Awaitable[None]]) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(body(), DEADLINE_S)

    asyncio.run(bounded())


async def _step(awaitable: Awaitable[T], what: str) -> T:
    try:
        return await asyncio.wait_for(awaitable, STEP_S)
    except TimeoutError:
        pytest.fail(f"{what}: nothing after {STEP_S} s (a hang)")


# ----- 1. RecordSealing and SealedReceiver alone -------------------------------------------------------
def _sealings(
    limit: int = 1 << 36,
    secrets: tuple[bytes, bytes] | None = None,
    records: int = 1 << 24,
    size: int = MAX_RECORD_BYTES,
) -> tuple[RecordSealing, RecordSealing]:
    """(a, b): a's send secret is b's receive secret and the other way round, as after a negotiation."""
    one, two = secrets if secrets is not None else (os.urandom(32), os.urandom(32))
    return (
        RecordSealing(one, two, limit, records, record_bytes=size),
        RecordSealing(two, one, limit, records, record_bytes=size),
    )


def _seal(sealing: RecordSealing, message: bytes) -> bytes:
    out = bytearray(sealed_size(len(message), sealing.record_bytes))
    end = sealing.seal_into(message, memoryview(out))
    assert end == len(out)
    return bytes(out)


def _close(sealing: RecordSealing) -> bytes:
    out = bytearray(sealed_size(0))
    sealing.seal_close_into(memoryview(out))
    return bytes(out)


def _receive(sealing: RecordSealing, stream: bytes) -> tuple[list[bytes], Exception | None]:
    """Open the records of ``stream`` one after the other as ``RawConnection`` does; the messages
    opened (a close as b""), then the error that stopped it (None: all)."""
    receiver = SealedReceiver(sealing, views=False)
    view = memoryview(stream)
    messages: list[bytes] = []
    at = 0
    try:
        while at < len(stream):
            need = receiver.header(view[at : at + HEADER.size])
            at += HEADER.size
            assert at + need <= len(stream), "the test stream ended inside a record: give it more bytes"
            message = receiver.body(view[at : at + need])
            at += need
            if message is END:
                messages.append(b"")
                break
            if message is not None:
                messages.append(message)  # type: ignore[arg-type]
    except SealedRecordError as exc:
        return messages, exc
    return messages, None


def test_messages_of_every_size_round_trip_both_ways_in_records_of_at_most_1_mib() -> None:
    a, b = _sealings()
    for size in (0, 1, 16 << 10, MAX_RECORD_BYTES, MAX_RECORD_BYTES + 1, (3 << 20) + 5):
        message = os.urandom(size)
        sealed = _seal(a, message)
        records = max(1, -(-size // MAX_RECORD_BYTES))
        assert len(sealed) == size + records * (HEADER.size + TAG_BYTES)
        kinds, at = [], 0
        while at < len(sealed):
            kind, length, total = HEADER.unpack(sealed[at : at + HEADER.size])
            assert length <= MAX_RECORD_BYTES and total == size
            kinds.append(kind)
            at += HEADER.size + length + TAG_BYTES
        assert kinds == [PART] * (records - 1) + [LAST]
        if size >= 16:
            assert message[:16] not in sealed  # encrypted, not just authenticated
        assert _receive(b, sealed) == ([message], None)
        assert _receive(a, _seal(b, message)) == ([message], None)


def test_the_nonce_is_the_secret_iv_xor_the_record_number_as_in_rfc_8446() -> None:
    secret = os.urandom(32)
    a = RecordSealing(secret, os.urandom(32))
    expand = lambda label, n: HKDFExpand(hashes.SHA256(), n, info=b"nebula sealed v2 " + label).derive(secret)  # noqa: E731
    key, iv = expand(b"key", 32), expand(b"iv", 12)
    aead = AESGCM(key)
    for number in range(3):
        record = _seal(a, b"message %d" % number)
        nonce = (int.from_bytes(iv, "big") ^ number).to_bytes(12, "big")
        header, body = record[: HEADER.size], record[HEADER.size :]
        assert aead.decrypt(nonce, body, header) == b"message %d" % number
        assert iv not in record and nonce not in record  # never sent


@pytest.mark.parametrize("budget", ["bytes", "records"])
def test_records_round_trip_across_many_key_updates_and_each_key_seals_differently(budget: str) -> None:
    limit, records = (100, 1 << 24) if budget == "bytes" else (1 << 36, 3)
    a, b = _sealings(limit, records=records)
    same = b"thirty bytes of one plaintext!"
    assert len(same) == 30  # three records fill a key's budget; the fourth moves to the next
    sealed = [_seal(a, same) for _ in range(30)]  # ten keys
    messages, error = _receive(b, b"".join(sealed))
    assert error is None and messages == [same] * 30
    # Records 0, 3, 6, ... are each the first under a new key (record number 0 again): only a new key
    # and IV can make them differ -- an update that kept them would reuse nonces.
    firsts = [sealed[index] for index in range(0, 30, 3)]
    assert len(set(firsts)) == len(firsts)
    # A receiver that never moves to the next key opens the first three records, then none.
    secrets = (os.urandom(32), os.urandom(32))
    updating, _ = _sealings(limit, secrets, records)
    _, stuck = _sealings(1 << 36, secrets)
    messages, error = _receive(stuck, b"".join(_seal(updating, same) for _ in range(4)))
    assert messages == [same] * 3
    assert isinstance(error, SealedRecordError) and "authentication" in str(error)


def test_every_flipped_bit_of_a_record_is_refused_and_nothing_wrong_is_delivered() -> None:
    secrets = (os.urandom(32), os.urandom(32))
    a, _ = _sealings(secrets=secrets)
    m0, m1, m2 = b"A" * 100, b"B" * 100, b"C" * 100
    r0, r1, r2 = _seal(a, m0), _seal(a, m1), _seal(a, m2)
    tail = r2 + bytes(4096)  # whatever a changed length makes the receiver wait for is there
    causes: dict[str, set[str]] = {"kind": set(), "lengths": set(), "ciphertext": set(), "tag": set()}
    for bit in range(len(r1) * 8):
        changed = bytearray(r1)
        changed[bit // 8] ^= 1 << (bit % 8)
        _, receiver = _sealings(secrets=secrets)
        messages, error = _receive(receiver, r0 + bytes(changed) + tail)
        assert messages == [m0], f"bit {bit}: delivered {len(messages)} messages"
        assert isinstance(error, SealedRecordError), f"bit {bit}: no error"
        byte = bit // 8
        part = (
            "kind"
            if byte == 0
            else "lengths"
            if byte < HEADER.size
            else "ciphertext"
            if byte < HEADER.size + len(m1)
            else "tag"
        )
        causes[part].add(str(error))
    auth = "a sealed record failed authentication (changed, replayed, reordered or cut on the way)"
    assert causes["ciphertext"] == {auth} and causes["tag"] == {auth}
    assert causes["kind"] and all(cause.startswith("a sealed") for cause in causes["kind"])
    assert all("sealed" in cause for cause in causes["lengths"])  # refused by the header's rules


@pytest.mark.parametrize(
    "order",
    [[1, 0, 2, 3], [0, 0, 1, 2], [0, 2, 3], [0, 1, 3], [1, 2, 3]],
    ids=["reordered", "replayed", "skipped", "dropped-before-last", "first-dropped"],
)
def test_records_opened_out_of_order_twice_or_with_one_missing_are_refused(order: list[int]) -> None:
    a, b = _sealings()
    messages = [bytes([index]) * (10 + index) for index in range(4)]
    records = [_seal(a, message) for message in messages]
    opened, error = _receive(b, b"".join(records[index] for index in order))
    in_order = 0
    while in_order < len(order) and order[in_order] == in_order:
        in_order += 1
    assert opened == messages[:in_order]  # those before the first wrong record, and nothing after
    assert isinstance(error, SealedRecordError) and "failed authentication" in str(error)


def test_the_parts_of_a_message_cannot_be_reordered_dropped_or_spliced_into_another() -> None:
    secrets = (os.urandom(32), os.urandom(32))
    a, _ = _sealings(secrets=secrets, size=64)
    one, two = os.urandom(200), os.urandom(200)
    parts_one = [_seal(a, one)[i : i + HEADER.size + 64 + TAG_BYTES] for i in range(0, 4 * 89, 89)]
    sealed_two = _seal(a, two)
    for stream in (
        parts_one[1] + parts_one[0],  # reordered
        parts_one[0] + parts_one[2],  # a part dropped
        parts_one[0] + sealed_two[89:],  # the rest of another message
    ):
        _, b = _sealings(secrets=secrets)
        opened, error = _receive(b, stream + bytes(256))
        assert opened == [] and isinstance(error, SealedRecordError), (opened, error)


def test_a_record_sealed_in_one_direction_cannot_be_opened_as_the_other_directions() -> None:
    secrets = (os.urandom(32), os.urandom(32))
    a, b = _sealings(secrets=secrets)
    to_b, to_a = _seal(a, b"for b"), _seal(b, b"for a")
    for sealing, record in ((a, to_b), (b, to_a)):  # reflected back to its sender
        messages, error = _receive(sealing, record)
        assert messages == [] and isinstance(error, SealedRecordError)
    a, b = _sealings(secrets=secrets)  # the right receivers open them
    assert _receive(b, to_b) == ([b"for b"], None)
    assert _receive(a, to_a) == ([b"for a"], None)


def test_a_close_record_is_authenticated_like_a_message() -> None:
    a, b = _sealings()
    close = _close(a)
    assert HEADER.unpack(close[: HEADER.size]) == (CLOSE, 0, 0)
    assert _receive(b, close) == ([b""], None)
    # An empty message relabelled CLOSE (a forged end) fails authentication.
    a, b = _sealings()
    forged = bytearray(_seal(a, b""))
    forged[0] = CLOSE
    messages, error = _receive(b, bytes(forged))
    assert messages == [] and isinstance(error, SealedRecordError) and "authentication" in str(error)


# ----- 2. The negotiation over real mutual TLS -----------------------------------------------------------
def test_both_wanting_sealed_records_get_crossed_sealings_keyed_by_the_exporter(
    identities: dict[str, ServiceTlsFiles],
) -> None:
    dialer_tls, acceptor_tls = _handshaken(identities)
    dialer, acceptor = _concurrently(
        lambda: dialer_tls.negotiate(True), lambda: acceptor_tls.negotiate(False)
    )
    assert not isinstance(dialer, BaseException) and not isinstance(acceptor, BaseException)
    (dialer_sock, dialer_sealing), (acceptor_sock, acceptor_sealing) = dialer, acceptor
    assert dialer_sealing is not None and acceptor_sealing is not None
    assert dialer_sock is dialer_tls.sock and acceptor_sock is acceptor_tls.sock  # the bare TCP sockets
    context = NEGOTIATION.pack(MAGIC, 1) * 2
    exported = dialer_tls.conn.export_keying_material(EXPORTER_LABEL, 64, context)
    assert exported == acceptor_tls.conn.export_keying_material(EXPORTER_LABEL, 64, context)
    assert RecordSealing(exported[:32], exported[32:])._send._iv == dialer_sealing._send._iv
    try:
        to_acceptor, to_dialer = (
            _seal(dialer_sealing, b"dialer says hi"),
            _seal(acceptor_sealing, b"acceptor too"),
        )
        dialer_tls.sock.sendall(to_acceptor)
        acceptor_tls.sock.sendall(to_dialer)
        assert _receive(acceptor_sealing, _recv_all(acceptor_tls.sock, len(to_acceptor))) == (
            [b"dialer says hi"],
            None,
        )
        assert _receive(dialer_sealing, _recv_all(dialer_tls.sock, len(to_dialer))) == (
            [b"acceptor too"],
            None,
        )
        messages, error = _receive(dialer_sealing, _seal(dialer_sealing, b"reflected"))
        assert messages == [] and isinstance(error, SealedRecordError)
    finally:
        dialer_tls.close()
        acceptor_tls.close()
    # Another connection between the same two gets other keys.
    again_dialer, again_acceptor = _handshaken(identities)
    try:
        assert again_dialer.conn.export_keying_material(EXPORTER_LABEL, 64, context) != exported
    finally:
        again_dialer.close()
        again_acceptor.close()


def _recv_all(sock: socket.socket, size: int) -> bytes:
    sock.settimeout(IO_TIMEOUT_S)
    data = b""
    while len(data) < size:
        part = sock.recv(size - len(data))
        assert part, f"the peer ended after {len(data)} of {size} bytes"
        data += part
    return data


def test_an_acceptor_declines_a_wish_for_tls_records_and_says_why(
    identities: dict[str, ServiceTlsFiles],
) -> None:
    """An older dialer that wishes TLS records is answered 0 (so it can tell why) and refused."""
    dialer_tls, acceptor_tls = _handshaken(identities)

    def old_dialer() -> bytes:
        dialer_tls.sendall(NEGOTIATION.pack(MAGIC, 0))
        return dialer_tls.recv_exact(NEGOTIATION.size)

    try:
        answer, acceptor = _concurrently(old_dialer, lambda: acceptor_tls.negotiate(False))
        assert answer == NEGOTIATION.pack(MAGIC, 0)
        assert isinstance(acceptor, SealedRecordError), acceptor
        assert "wishes TLS records instead of sealed ones" in str(acceptor)
    finally:
        dialer_tls.close()
        acceptor_tls.close()


@pytest.mark.parametrize(
    ("offer", "reason"),
    [
        (NEGOTIATION.pack(b"NBSEAL3", 1), "is not a sealed-records offer"),
        (NEGOTIATION.pack(MAGIC, 2), "is not a sealed-records offer"),
        (NEGOTIATION.pack(OLD_MAGIC, 1), "update the older switch"),
        (b"\0\0\0\x24" + b"an o", "is not a sealed-records offer"),
    ],
    ids=["wrong-magic", "wish-out-of-range", "old-version", "a-plain-record"],
)
def test_an_acceptor_refuses_a_first_message_that_is_not_the_offer(
    identities: dict[str, ServiceTlsFiles], offer: bytes, reason: str
) -> None:
    assert len(offer) == NEGOTIATION.size
    dialer_tls, acceptor_tls = _handshaken(identities)
    try:
        _, acceptor = _concurrently(lambda: dialer_tls.sendall(offer), lambda: acceptor_tls.negotiate(False))
        assert isinstance(acceptor, SealedRecordError), acceptor
        assert reason in str(acceptor)
    finally:
        dialer_tls.close()
        acceptor_tls.close()


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (NEGOTIATION.pack(b"NBSEAL0", 1), "answered the sealed-records offer"),
        (NEGOTIATION.pack(MAGIC, 7), "answered the sealed-records offer"),
        (NEGOTIATION.pack(OLD_MAGIC, 1), "update the older switch"),
        (NEGOTIATION.pack(MAGIC, 0), "answered with TLS records instead of sealed ones"),
    ],
    ids=["wrong-magic", "decision-out-of-range", "old-version", "declined"],
)
def test_a_dialer_refuses_an_answer_that_is_not_sealed_records(
    identities: dict[str, ServiceTlsFiles], answer: bytes, reason: str
) -> None:
    dialer_tls, acceptor_tls = _handshaken(identities)

    def fake_acceptor() -> bytes:
        offer = acceptor_tls.recv_exact(NEGOTIATION.size)
        acceptor_tls.sendall(answer)
        return offer

    try:
        dialer, offer = _concurrently(lambda: dialer_tls.negotiate(True), fake_acceptor)
        assert isinstance(offer, bytes) and NEGOTIATION.unpack(offer) == (MAGIC, 1)
        assert isinstance(dialer, SealedRecordError), dialer
        assert reason in str(dialer)
    finally:
        dialer_tls.close()
        acceptor_tls.close()


def test_an_acceptor_holding_bytes_past_the_offer_refuses_to_switch(
    identities: dict[str, ServiceTlsFiles],
) -> None:
    """Bytes after the offer inside its TLS record would be lost by the switch to the bare socket."""
    dialer_tls, acceptor_tls = _handshaken(identities)
    offer = NEGOTIATION.pack(MAGIC, 1)
    try:
        _, acceptor = _concurrently(
            lambda: dialer_tls.sendall(offer + b"early"), lambda: acceptor_tls.negotiate(False)
        )
        assert isinstance(acceptor, SealedRecordError) and "TLS holds bytes" in str(acceptor)
    finally:
        dialer_tls.close()
        acceptor_tls.close()


@pytest.mark.parametrize("side", ["dialer", "acceptor"])
def test_a_peer_that_stops_sending_during_the_negotiation_is_an_error_not_a_hang(
    identities: dict[str, ServiceTlsFiles], side: str
) -> None:
    dialer_tls, acceptor_tls = _handshaken(identities)
    offer = NEGOTIATION.pack(MAGIC, 1)

    def half_offer_then_end() -> None:
        dialer_tls.sendall(offer[:3])
        dialer_tls.sock.shutdown(socket.SHUT_WR)  # the TCP end, no close_notify

    def read_offer_then_end() -> None:
        acceptor_tls.recv_exact(NEGOTIATION.size)
        acceptor_tls.sock.shutdown(socket.SHUT_WR)

    started = time.monotonic()
    try:
        if side == "dialer":
            _, error = _concurrently(half_offer_then_end, lambda: acceptor_tls.negotiate(False))
        else:
            error, _ = _concurrently(lambda: dialer_tls.negotiate(True), read_offer_then_end)
        assert isinstance(error, SealedRecordError), error
        assert "closed the connection during the sealed-records negotiation" in str(error)
        assert time.monotonic() - started < IO_TIMEOUT_S  # its own end, not the deadline
    finally:
        dialer_tls.close()
        acceptor_tls.close()


def test_a_peer_that_says_nothing_during_the_negotiation_meets_the_deadline(
    identities: dict[str, ServiceTlsFiles],
) -> None:
    dialer_tls, acceptor_tls = _handshaken(identities)
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            negotiate_acceptor(acceptor_tls.conn, acceptor_tls.sock, time.monotonic() + 0.3)
        assert time.monotonic() - started < IO_TIMEOUT_S
    finally:
        dialer_tls.close()
        acceptor_tls.close()


# ----- 3. A man in the middle on the sealed stream ------------------------------------------------------
class _Attack:
    """What the proxy does to the dialer -> acceptor sealed records from record ``at`` on."""

    def __init__(self, name: str, at: int) -> None:
        self.name = name
        self.at = at
        self.applied = threading.Event()
        self._held: bytes | None = None

    def feed(self, index: int, record: bytes) -> tuple[list[bytes], bool]:
        """The bytes to forward for the ``index``-th whole record, and whether to cut the connection."""
        if index < self.at or (self.applied.is_set() and self._held is None):
            return [record], False
        changed = bytearray(record)
        parts: list[bytes]
        cut = False
        if self.name == "ciphertext-bit":
            changed[HEADER.size + (len(record) - HEADER.size - TAG_BYTES) // 2] ^= 0x04
            parts = [bytes(changed)]
        elif self.name == "length-bit":
            changed[4] ^= 0x01  # the record length's lowest bit: the record now takes one byte more
            parts = [bytes(changed)]
        elif self.name == "replay":
            parts = [record, record]
        elif self.name == "swap":
            if self._held is None:
                self._held = record
                return [], False
            parts, self._held = [record, self._held], None
        elif self.name == "drop":
            parts = []
        elif self.name == "cut":
            parts, cut = [], True
        elif self.name == "cut-inside":
            parts, cut = [record[: len(record) // 2]], True
        else:
            raise AssertionError(f"unknown attack {self.name}")
        self.applied.set()
        return parts, cut


class _Proxy:
    """A loopback TCP proxy: the dialer connects to it, it connects to the acceptor.

    It forwards both directions byte for byte (the TLS handshake and the negotiation included) until
    ``parse_from_here``; from then on it cuts the dialer -> acceptor bytes into whole sealed records
    (9-byte header, record plaintext, 16-byte tag) and hands each to the attack.
    """

    def __init__(self, target: tuple[str, int], attack: _Attack | None) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(IO_TIMEOUT_S)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._target = target
        self.attack = attack
        self._lock = threading.Lock()
        self._forwarded = 0  # dialer -> acceptor bytes forwarded before parsing
        self._tail = b""  # their last bytes
        self._parsing = False
        self.records: list[tuple[int, int, int]] = []  # (kind, length, message) of each record parsed
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._serve, name="mitm-accept", daemon=True)]
        self._threads[0].start()

    def parse_from_here(self, last_message: bytes) -> None:
        """Parse sealed records from the next dialer byte on; everything forwarded so far must end with
        the record of ``last_message`` (the dialer sent nothing since: the boundary is exact)."""
        size = sealed_size(len(last_message))
        with self._lock:
            assert self._forwarded > size, "nothing forwarded: the proxy is not in the path"
            header = self._tail[-size:][: HEADER.size]
            assert header == HEADER.pack(LAST, len(last_message), len(last_message)), (
                f"the dialer's bytes do not end with the sealed record of the first message: {header.hex()}"
            )
            self._parsing = True

    def close(self) -> None:
        for sock in [self._listener, *self._sockets]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in self._threads:
            thread.join(IO_TIMEOUT_S)
            assert not thread.is_alive(), f"{thread.name} did not end"

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            dialer, _ = self._listener.accept()
            acceptor = socket.create_connection(self._target, timeout=IO_TIMEOUT_S)
            self._sockets += [dialer, acceptor]
            for sock in (dialer, acceptor):
                sock.settimeout(DEADLINE_S)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for name, pump in (
                ("mitm-d2a", self._dialer_to_acceptor),
                ("mitm-a2d", self._acceptor_to_dialer),
            ):
                thread = threading.Thread(target=pump, args=(dialer, acceptor), name=name, daemon=True)
                self._threads.append(thread)
                thread.start()

    @staticmethod
    def _acceptor_to_dialer(dialer: socket.socket, acceptor: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while chunk := acceptor.recv(1 << 16):
                dialer.sendall(chunk)
        with contextlib.suppress(OSError):
            dialer.shutdown(socket.SHUT_WR)

    def _dialer_to_acceptor(self, dialer: socket.socket, acceptor: socket.socket) -> None:
        pending = bytearray()
        index = 0
        cut = False  # the acceptor's side is cut (or gone): the dialer's bytes are drained, not forwarded
        while True:
            try:
                chunk = dialer.recv(1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                break
            if cut:
                continue
            with self._lock:
                parsing = self._parsing
                if not parsing:  # counted before it can reach the acceptor
                    self._forwarded += len(chunk)
                    self._tail = (self._tail + chunk)[-(1 << 10) :]
            out: list[bytes] = []
            if not parsing:
                out.append(chunk)
            else:
                pending += chunk
                while len(pending) >= HEADER.size:
                    kind, length, total = HEADER.unpack_from(pending)
                    size = HEADER.size + length + TAG_BYTES
                    if len(pending) < size:
                        break
                    record = bytes(pending[:size])
                    del pending[:size]
                    with self._lock:
                        self.records.append((kind, length, total))
                    parts, cut = self.attack.feed(index, record) if self.attack else ([record], False)
                    index += 1
                    out += parts
                    if cut:
                        break
            try:
                acceptor.sendall(b"".join(out))
            except OSError:
                cut = True
            if cut:
                with contextlib.suppress(OSError):
                    acceptor.shutdown(socket.SHUT_WR)  # a TCP end right after the last forwarded byte
        if not cut:
            with contextlib.suppress(OSError):
                acceptor.shutdown(socket.SHUT_WR)


async def _through_proxy(
    identities: dict[str, ServiceTlsFiles], attack: _Attack | None, views: bool = False
) -> tuple[RawConnection, RawConnection, _Proxy]:
    """A sealed (dialer, acceptor) RawConnection pair whose every byte passes the proxy."""
    loop = asyncio.get_running_loop()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(IO_TIMEOUT_S)
    proxy = _Proxy(listener.getsockname()[:2], attack)
    client, server = _client(identities), _server(identities)

    def sealed(sock: socket.socket, dialer: bool) -> RawConnection:
        deadline = time.monotonic() + IO_TIMEOUT_S
        conn, cert = handshake(
            sock, client if dialer else server, server_name=NAME if dialer else None, deadline=deadline
        )
        side = negotiate_dialer if dialer else negotiate_acceptor
        carrier, sealing = side(conn, sock, deadline)
        assert sealing is not None, "the negotiation through the proxy did not seal"
        return RawConnection(
            carrier, "acceptor" if dialer else "dialer", loop, views=views, sealing=sealing, peer_cert=cert
        )

    def dial() -> RawConnection:
        return sealed(socket.create_connection(proxy.address, timeout=IO_TIMEOUT_S), True)

    def accept() -> RawConnection:
        sock, _ = listener.accept()
        return sealed(sock, False)

    try:
        results = await _step(
            asyncio.gather(
                in_thread(dial, "test-dial"), in_thread(accept, "test-accept"), return_exceptions=True
            ),
            "the handshake and the negotiation through the proxy",
        )
    finally:
        listener.close()
    for result in results:
        if isinstance(result, BaseException):
            for other in results:
                if isinstance(other, RawConnection):
                    await other.close()
            proxy.close()
            raise result
    dialer, acceptor = results
    assert isinstance(dialer, RawConnection) and isinstance(acceptor, RawConnection)
    return dialer, acceptor, proxy


FIRST = b"the first sealed message, passed through untouched"
SIZES = [100, 20_000, 70_000, 4_000, 1_000, 200_000, 64, 30_000, (2 << 20) + 10]
"""Even sizes: a flipped lowest length bit makes the attacked record claim one byte more. The last
message goes as three records."""
ATTACKED = 3
"""The proxy attacks the record after this many whole records (after FIRST)."""


def _messages() -> list[bytes]:
    return [bytes([index + 1]) * size for index, size in enumerate(SIZES)]


@pytest.mark.parametrize(
    ("attack", "expected", "delivered"),
    [
        ("ciphertext-bit", "failed authentication", ATTACKED),
        ("length-bit", "sealed last record ends its message", ATTACKED),
        ("replay", "failed authentication", ATTACKED + 1),  # the first copy is the genuine record
        ("swap", "failed authentication", ATTACKED),
        ("drop", "failed authentication", ATTACKED),
        ("cut", "the connection ended without its sealed close", ATTACKED),
        ("cut-inside", "the connection ended without its sealed close", ATTACKED),
    ],
)
def test_a_man_in_the_middle_gets_the_messages_before_the_attack_delivered_then_an_error(
    identities: dict[str, ServiceTlsFiles], attack: str, expected: str, delivered: int
) -> None:
    messages = _messages()

    async def body() -> None:
        tamper = _Attack(attack, ATTACKED)
        dialer, acceptor, proxy = await _through_proxy(identities, tamper)
        try:
            await _step(dialer.write(FIRST), "the first write")
            assert await _step(acceptor.read(), "the first message") == FIRST
            proxy.parse_from_here(FIRST)

            async def send() -> None:
                with contextlib.suppress(RawConnectionError):  # the acceptor may be gone already
                    for message in messages:
                        await dialer.write(message)

            sender = asyncio.create_task(send())
            for index, message in enumerate(messages[:delivered]):
                got = await _step(acceptor.read(), f"message {index} (before the attack)")
                assert got == message, f"message {index} changed"
            with pytest.raises(RawConnectionError, match=expected):
                got = await _step(acceptor.read(), "the read after the attack")
                pytest.fail(f"a message was delivered after the attack: {len(got)} bytes")  # type: ignore[arg-type]
            assert tamper.applied.is_set()
            with pytest.raises(RawConnectionError):  # and it stays failed
                await _step(acceptor.read(), "a second read after the attack")
            await _step(sender, "the dialer's writes")
        finally:
            await _step(asyncio.gather(dialer.close(), acceptor.close()), "the closes")
            proxy.close()

    _run(body)


def test_a_faithful_proxy_delivers_everything_and_a_close_arrives_as_the_sealed_end(
    identities: dict[str, ServiceTlsFiles],
) -> None:
    messages = _messages()

    async def body() -> None:
        dialer, acceptor, proxy = await _through_proxy(identities, None)
        try:
            await _step(dialer.write(FIRST), "the first write")
            assert await _step(acceptor.read(), "the first message") == FIRST
            proxy.parse_from_here(FIRST)

            async def send() -> None:
                for message in messages:
                    await dialer.write(message)

            sender = asyncio.create_task(send())
            for index, message in enumerate(messages):
                assert await _step(acceptor.read(), f"message {index}") == message, f"message {index} changed"
            await _step(sender, "the dialer's writes")
            await _step(acceptor.write(b"and back"), "the acceptor's write")
            assert await _step(dialer.read(), "the answer") == b"and back"
            await _step(dialer.close(), "the dialer's close")
            assert await _step(acceptor.read(), "the end") is grpc.aio.EOF
            assert await _step(acceptor.read(), "the end again") is grpc.aio.EOF
            records = [(LAST, len(message), len(message)) for message in messages[:-1]]
            big = len(messages[-1])
            records += [(PART, MAX_RECORD_BYTES, big)] * 2 + [(LAST, big - 2 * MAX_RECORD_BYTES, big)]
            assert proxy.records == [*records, (CLOSE, 0, 0)]
        finally:
            await _step(asyncio.gather(dialer.close(), acceptor.close()), "the closes")
            proxy.close()

    _run(body)


# ----- 4. Large sealed messages as views ----------------------------------------------------------------
def test_a_large_sealed_message_is_handed_on_as_a_view_of_its_own_buffer(
    identities: dict[str, ServiceTlsFiles],
) -> None:
    size = (3 << 20) + 7
    first = (bytes(range(251)) * (size // 251 + 1))[:size]
    second = bytes(reversed(first))

    async def body() -> None:
        dialer, acceptor, proxy = await _through_proxy(identities, None, views=True)
        try:
            for message in (first, second, b"small"):
                await _step(dialer.write(message), "a write")
            one = await _step(acceptor.read(), "the first large message")
            two = await _step(acceptor.read(), "the second large message")
            three = await _step(acceptor.read(), "the small message")
            assert isinstance(one, memoryview) and isinstance(two, memoryview)
            assert one.obj is not None and two.obj is not None and one.obj is not two.obj
            assert len(one) == size and bytes(one) == first  # not overwritten by the second
            assert len(two) == size and bytes(two) == second
            assert isinstance(three, bytes) and three == b"small"
        finally:
            await _step(asyncio.gather(dialer.close(), acceptor.close()), "the closes")
            proxy.close()

    _run(body)
