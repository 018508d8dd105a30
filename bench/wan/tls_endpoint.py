"""What one end of one encrypted hop costs: CPU-seconds per GB at the sender and at the receiver.

The relay path has six TLS endpoints (sender, switch a in + out, switch b in + out, receiver) against
two in the single TLS hop it is compared with, on the same 2 cores; so whatever one endpoint costs
bounds the relay's ratio (``docs/bench/relay.md``). This measures each way of carrying the bytes over
one loopback TCP connection, the sender and the receiver each in a process of its own (user + system
CPU of that process, ``time.process_time``), the variants alternating so they share the load:

* ``tcp``: plain TCP, ``sendall`` / ``recv_into`` of 1 MiB (the kernel's share of every variant);
* ``ssl``: Python ``ssl.SSLSocket``, TLS 1.3, mutual, with mutual TLS 1.3 contexts (what
  ``RawConnection`` does: one ``SSL_write`` / ``write()`` per 16 KiB record, two ``read()`` per record);
* ``bio``: the same TLS through ``ssl.MemoryBIO`` / ``SSLObject``: one ``recv_into`` of up to 1 MiB feeds
  many records, one ``sendall`` per 1 MiB of ciphertext;
* ``aead``: AES-256-GCM (``cryptography``'s ``AESGCM.encrypt_into`` / ``decrypt_into``) of 1 MiB records
  on plain TCP, with a fixed test key: the floor an encrypted record layer with large records could reach
  (no key exchange here; this is a cost measurement, not a transport);
* ``aead128``: the same with AES-128-GCM;
* ``tls+aead``: the mechanism such a record layer would use, end to end: the mutual TLS 1.3 handshake
  with the same contexts (no session tickets), each side sends a fresh 32-byte secret through the
  verified TLS session, HKDF-SHA256 of both secrets gives one AES-256-GCM key per direction, the TLS
  socket is detached (OpenSSL holds no byte beyond the secret's record: checked) and 1 MiB records with
  counter nonces follow on the same TCP connection; the receiver checks the plaintext of every record.

    .venv/bin/python bench/wan/tls_endpoint.py --gib 1 --rounds 2

Never part of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import ssl
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

MIB = 1 << 20
MODES = ("tcp", "ssl", "bio", "aead", "aead128", "tls+aead")
PATTERN = bytes(range(256)) * (MIB // 256)


def _contexts(pki: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    from nebula_common.pki.service_identity import ServiceTlsFiles, service_tls_dir
    from tests.support.raw_tls import client_context, server_context

    switch = ServiceTlsFiles.in_dir(service_tls_dir(Path(pki), "a", "switch"))
    trainer = ServiceTlsFiles.in_dir(service_tls_dir(Path(pki), "a", "trainer"))
    server = server_context(str(switch.cert), str(switch.key), str(switch.ca))
    server.num_tickets = 0  # no post-handshake records that could trail the key exchange
    client = client_context(str(trainer.cert), str(trainer.key), str(trainer.ca))
    return server, client


def _bio_handshake(
    context: ssl.SSLContext, sock: socket.socket, server_side: bool, name: str | None
) -> tuple[ssl.SSLObject, ssl.MemoryBIO, ssl.MemoryBIO]:
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = context.wrap_bio(incoming, outgoing, server_side=server_side, server_hostname=name)
    while True:
        try:
            obj.do_handshake()
            done = True
        except ssl.SSLWantReadError:
            done = False
        pending = outgoing.read()
        if pending:
            sock.sendall(pending)
        if done:
            return obj, incoming, outgoing
        data = sock.recv(MIB)
        if not data:
            raise ConnectionError("peer closed during the handshake")
        incoming.write(data)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("sender closed early")
        got += n


def _exchange_keys(tls: ssl.SSLSocket, server_side: bool) -> tuple[socket.socket, Any, Any]:
    """Secrets through the verified TLS session, a key per direction, then the bare TCP socket."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    mine = os.urandom(32)
    tls.sendall(mine)
    theirs = memoryview(bytearray(32))
    got = 0
    while got < 32:
        n = tls.recv_into(theirs[got:])
        if n == 0:
            raise ConnectionError("peer closed during the key exchange")
        got += n
    if tls.pending():
        raise RuntimeError("TLS holds bytes beyond the key exchange: the record layer cannot take over")
    client, server = (bytes(theirs), mine) if server_side else (mine, bytes(theirs))
    keys = HKDF(hashes.SHA256(), 64, salt=b"nebula raw records v1", info=b"c2s|s2c").derive(client + server)
    send_key, receive_key = (keys[32:], keys[:32]) if server_side else (keys[:32], keys[32:])
    raw = socket.socket(fileno=tls.detach())
    return raw, AESGCM(send_key), AESGCM(receive_key)


def _key(mode: str) -> Any:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(b"k" * (16 if mode == "aead128" else 32))  # a cost measurement: the key is no secret


def receiver(mode: str, sock: socket.socket, pki: str, total: int, results: Any) -> None:
    server, _ = _contexts(pki)
    plain = memoryview(bytearray(MIB))
    got = 0
    if mode == "tcp":
        start = time.process_time()
        while got < total:
            got += sock.recv_into(plain)
    elif mode == "ssl":
        tls = server.wrap_socket(sock, server_side=True)
        start = time.process_time()
        while got < total:
            got += tls.recv_into(plain)
    elif mode == "bio":
        obj, incoming, _ = _bio_handshake(server, sock, True, None)
        received = memoryview(bytearray(MIB))
        start = time.process_time()
        while got < total:
            n = sock.recv_into(received)
            incoming.write(received[:n])
            while True:
                try:
                    got += obj.read(MIB, plain)
                except ssl.SSLWantReadError:
                    break
    elif mode == "tls+aead":
        raw, _, opener = _exchange_keys(server.wrap_socket(sock, server_side=True), server_side=True)
        record = memoryview(bytearray(MIB + 16))
        start = time.process_time()
        sequence = 0
        while got < total:
            _recv_exact(raw, record)
            opener.decrypt_into(sequence.to_bytes(12, "big"), record, None, plain)
            if plain[:64] != PATTERN[:64] or plain[-64:] != PATTERN[-64:]:
                raise RuntimeError(f"record {sequence} decrypted to the wrong bytes")
            sequence += 1
            got += MIB
    else:
        aead = _key(mode)
        record = memoryview(bytearray(MIB + 16))
        start = time.process_time()
        sequence = 0
        while got < total:
            _recv_exact(sock, record)
            aead.decrypt_into(sequence.to_bytes(12, "big"), record, None, plain)
            sequence += 1
            got += MIB
    results.put(("receiver", time.process_time() - start))


def sender(mode: str, sock: socket.socket, pki: str, total: int, results: Any) -> None:
    from nebula_common.rpc.internal_tls import server_name

    _, client = _contexts(pki)
    data = os.urandom(MIB)
    view = memoryview(data)
    name = server_name("switch", "a")
    if mode == "tcp":
        start = time.process_time()
        for _ in range(total // MIB):
            sock.sendall(data)
    elif mode == "ssl":
        tls = client.wrap_socket(sock, server_hostname=name)
        start = time.process_time()
        for _ in range(total // MIB):
            tls.sendall(data)
    elif mode == "bio":
        obj, _, outgoing = _bio_handshake(client, sock, False, name)
        start = time.process_time()
        for _ in range(total // MIB):
            offset = 0
            while offset < MIB:
                offset += obj.write(view[offset:])
            sock.sendall(outgoing.read())
    elif mode == "tls+aead":
        raw, sealer, _ = _exchange_keys(client.wrap_socket(sock, server_hostname=name), server_side=False)
        record = bytearray(MIB + 16)
        start = time.process_time()
        for sequence in range(total // MIB):
            sealer.encrypt_into(sequence.to_bytes(12, "big"), PATTERN, None, record)
            raw.sendall(record)
    else:
        aead = _key(mode)
        record = bytearray(MIB + 16)
        start = time.process_time()
        for sequence in range(total // MIB):
            aead.encrypt_into(sequence.to_bytes(12, "big"), data, None, record)
            sock.sendall(record)
    results.put(("sender", time.process_time() - start))


def run(mode: str, pki: str, total: int) -> dict[str, float]:
    context = mp.get_context("fork")
    listener = socket.create_server(("127.0.0.1", 0))
    left = socket.create_connection(listener.getsockname())
    right, _ = listener.accept()
    listener.close()
    for sock in (left, right):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    results = context.Queue()
    began = time.monotonic()
    processes = [
        context.Process(target=receiver, args=(mode, right, pki, total, results)),
        context.Process(target=sender, args=(mode, left, pki, total, results)),
    ]
    for process in processes:
        process.start()
    found = dict(results.get(timeout=600) for _ in processes)
    for process in processes:
        process.join(60)
    wall = time.monotonic() - began
    left.close()
    right.close()
    gb = total / 1e9
    return {
        "mb_s": total / 1e6 / wall,
        "sender_cpu_s_per_gb": found["sender"] / gb,
        "receiver_cpu_s_per_gb": found["receiver"] / gb,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="bytes moved per variant and round, GiB")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = parser.parse_args()
    from nebula_common.pki import init_pki
    from nebula_common.pki.service_identity import ensure_service_certificates

    total = int(args.gib * (1 << 30)) // MIB * MIB
    load_before = os.getloadavg()
    rows: dict[str, list[dict[str, float]]] = {mode: [] for mode in args.modes}
    with tempfile.TemporaryDirectory(prefix="tls-endpoint-") as root:
        init_pki(Path(root), ["a", "b"])
        ensure_service_certificates(Path(root), "a")
        for round_ in range(args.rounds):
            for mode in args.modes:
                row = run(mode, root, total)
                rows[mode].append(row)
                print(
                    f"round {round_ + 1} {mode:8s} {row['mb_s']:6.0f} MB/s  sender "
                    f"{row['sender_cpu_s_per_gb']:.2f}  receiver {row['receiver_cpu_s_per_gb']:.2f} CPU-s/GB",
                    flush=True,
                )
    load_after = os.getloadavg()
    print(f"load {load_before[0]:.1f} -> {load_after[0]:.1f}; medians over {args.rounds} rounds:")
    print("| variant | sender CPU-s/GB | receiver CPU-s/GB | both ends | MB/s |")
    print("|---|---|---|---|---|")
    summary = {}
    for mode, found in rows.items():
        send = statistics.median(r["sender_cpu_s_per_gb"] for r in found)
        receive = statistics.median(r["receiver_cpu_s_per_gb"] for r in found)
        mb_s = statistics.median(r["mb_s"] for r in found)
        summary[mode] = {"sender": send, "receiver": receive, "mb_s": mb_s}
        print(f"| {mode} | {send:.2f} | {receive:.2f} | {send + receive:.2f} | {mb_s:.0f} |")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"load": [load_before[0], load_after[0]], "rows": rows, "median": summary}, indent=1)
        )


if __name__ == "__main__":
    main()
