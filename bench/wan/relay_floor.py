"""The relay's floor: four processes, three hops, only the transports; which design can reach 0.50?

The product's relay is sender -> switch a -> switch b -> receiver: four processes, three hops, on
2 cores, against one TLS hop of two processes (``docs/bench/relay.md``). This strips the relay to
its transports: each forwarder reads a small header and a 1 MiB payload and writes them on (a
reader thread and the main thread as writer, a few buffers between them, no routing, no protobuf,
no credit), the sender frames 64 MiB tensors into 1 MiB chunks, the receiver assembles them into a
reused 64 MiB buffer. Each hop is one of:

* ``tls``: mutual TLS 1.3 on loopback TCP with Python ``ssl`` (what ``RawConnection`` carries today);
* ``uds``: a Unix domain stream socket, no encryption (a trainer co-located with its switch);
* ``aead``: the mutual TLS 1.3 handshake, a fresh 32-byte secret from each side through the verified
  session, HKDF-SHA256 to one AES-256-GCM key per direction, then the TLS socket detached and one
  record per chunk on the same TCP connection: a 16-byte header (length, sequence number) as
  associated data, counter nonces, ``cryptography``'s ``encrypt_into`` / ``decrypt_into``
  (``bench/wan/tls_endpoint.py``'s ``tls+aead`` mechanism);
* ``tcp``: plain loopback TCP (no encryption: the kernel's share, a reference only).

A configuration names the three hops (``tls/aead/tls``: TLS edges, AEAD link). ``hop-tls`` is the
single TLS hop the relay is compared with, shaped as ``bench/wan/relay.py``'s ``tls`` path (two
processes, 64 MiB ``sendall`` / ``recv_into``). The configurations take turns every round, so the
ratios share the load; CPU-seconds per GB are each process's user + system CPU over the timed tensors.

    flock /tmp/nebula-bench.lock setsid sh -c 'echo -15 > /proc/$$/autogroup; \
        exec nice -n -15 .venv/bin/python bench/wan/relay_floor.py --rounds 3'

Never part of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from relay import cpu_seconds, load_info
from tls_endpoint import _contexts, _exchange_keys, _recv_exact

MIB = 1 << 20
CHUNK = MIB
HEADER = struct.Struct(">QQ")  # payload length, chunk sequence number
TAG = 16
CONFIGS = (
    "hop-tls",
    "tls/tls/tls",
    "uds/tls/uds",
    "tls/aead/tls",
    "uds/aead/uds",
    "aead/aead/aead",
    "uds/tcp/uds",
)
KINDS = ("tls", "uds", "aead", "tcp")
UDS_BUFFER = int(os.environ.get("RELAY_FLOOR_UDS_BUFFER", 4 * MIB))


class Hop:
    """One end of one hop: ``send(header, payload)`` and ``receive_into(header, payload)``."""

    def __init__(self, kind: str, sock: socket.socket, pki: str, server_side: bool) -> None:
        self.kind = kind
        self.sealer: Any = None
        self.opener: Any = None
        self.sent = 0
        self.received = 0
        if kind in ("tls", "aead"):
            from nebula_common.rpc.internal_tls import server_name

            server, client = _contexts(pki)
            if server_side:
                tls = server.wrap_socket(sock, server_side=True)
            else:
                tls = client.wrap_socket(sock, server_hostname=server_name("switch", "a"))
            if kind == "tls":
                self.sock: Any = tls
            else:
                self.sock, self.sealer, self.opener = _exchange_keys(tls, server_side)
                self.record = bytearray(CHUNK + TAG)
        else:
            self.sock = sock

    def send(self, header: bytes, payload: memoryview) -> None:
        if self.sealer is not None:
            nonce = self.sent.to_bytes(12, "big")
            self.sent += 1
            record = memoryview(self.record)[: len(payload) + TAG]
            self.sealer.encrypt_into(nonce, payload, header, record)
            self.sock.sendall(header)
            self.sock.sendall(record)
        elif self.kind == "tls":
            self.sock.sendall(header)
            self.sock.sendall(payload)
        else:
            sent = self.sock.sendmsg([header, payload])  # one system call for header and payload
            if sent < len(header):
                self.sock.sendall(header[sent:])
                sent = len(header)
            if sent - len(header) < len(payload):
                self.sock.sendall(payload[sent - len(header) :])

    def receive_into(self, header: memoryview, payload: memoryview) -> int:
        _recv_exact(self.sock, header)
        length, _ = HEADER.unpack(header)
        if self.opener is not None:
            record = memoryview(self.record)[: length + TAG]
            _recv_exact(self.sock, record)
            nonce = self.received.to_bytes(12, "big")
            self.received += 1
            self.opener.decrypt_into(nonce, record, bytes(header), payload[:length])
        else:
            _recv_exact(self.sock, payload[:length])
        return int(length)


def _pair(kind: str) -> tuple[socket.socket, socket.socket]:
    """(upstream end, downstream end) of one hop's connection."""
    if kind == "uds":
        pair = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for sock in pair:  # the default (~208 KiB) blocks a 1 MiB write about five times
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UDS_BUFFER)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, UDS_BUFFER)
        return pair
    listener = socket.create_server(("127.0.0.1", 0))
    left = socket.create_connection(listener.getsockname())
    right, _ = listener.accept()
    listener.close()
    for sock in (left, right):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return left, right


def sender(kind: str, sock: socket.socket, pki: str, size: int, count: int, go: Any) -> None:
    hop = Hop(kind, sock, pki, server_side=False)
    tensor = memoryview(os.urandom(size))

    def one(sequence: int) -> int:
        for offset in range(0, size, CHUNK):
            payload = tensor[offset : offset + CHUNK]
            hop.send(HEADER.pack(len(payload), sequence), payload)
            sequence += 1
        return sequence

    sequence = one(0)  # warm-up
    go.wait()
    for _ in range(count):
        sequence = one(sequence)
    time.sleep(0.5)  # the receiver reports when it holds the last tensor; keep the socket open till then


def forwarder(
    up: str, down: str, upsock: socket.socket, downsock: socket.socket, pki: str, total: int
) -> None:
    inbound = Hop(up, upsock, pki, server_side=True)
    outbound = Hop(down, downsock, pki, server_side=False)
    free: queue.Queue[tuple[bytearray, bytearray]] = queue.Queue()
    for _ in range(4):
        free.put((bytearray(HEADER.size), bytearray(CHUNK)))
    full: queue.Queue[tuple[bytearray, bytearray, int] | None] = queue.Queue()

    def read() -> None:
        for _ in range(total):
            header, payload = free.get()
            length = inbound.receive_into(memoryview(header), memoryview(payload))
            full.put((header, payload, length))
        full.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while (item := full.get()) is not None:
        header, payload, length = item
        outbound.send(bytes(header), memoryview(payload)[:length])
        free.put((header, payload))
    time.sleep(0.5)


def receiver(kind: str, sock: socket.socket, pki: str, size: int, count: int, done: Any) -> None:
    hop = Hop(kind, sock, pki, server_side=True)
    assembly = memoryview(bytearray(size))
    header = memoryview(bytearray(HEADER.size))
    expected = 0
    for index in range(count + 1):
        offset = 0
        while offset < size:
            offset += hop.receive_into(header, assembly[offset : offset + CHUNK])
            _, sequence = HEADER.unpack(header)
            if sequence != expected:
                raise RuntimeError(f"chunk {sequence} arrived where {expected} was due")
            expected += 1
        if index == 0:
            done.put("warm")
    done.put(time.monotonic())


def single_receiver(sock: socket.socket, pki: str, size: int, count: int, done: Any) -> None:
    tls = _contexts(pki)[0].wrap_socket(sock, server_side=True)
    buffer = memoryview(bytearray(size))
    for index in range(count + 1):
        _recv_exact(tls, buffer)
        if index == 0:
            done.put("warm")
    done.put(time.monotonic())


def single_sender(sock: socket.socket, pki: str, size: int, count: int, go: Any) -> None:
    from nebula_common.rpc.internal_tls import server_name

    tls = _contexts(pki)[1].wrap_socket(sock, server_hostname=server_name("switch", "a"))
    tensor = os.urandom(size)
    tls.sendall(tensor)
    go.wait()
    for _ in range(count):
        tls.sendall(tensor)
    time.sleep(0.5)


def run(config: str, pki: str, size: int, count: int) -> dict[str, Any]:
    context = mp.get_context("fork")
    done = context.Queue()
    go = context.Event()
    if config == "hop-tls":
        left, right = _pair("tls")
        processes = {
            "receiver": context.Process(target=single_receiver, args=(right, pki, size, count, done)),
            "sender": context.Process(target=single_sender, args=(left, pki, size, count, go)),
        }
        sockets = [left, right]
    else:
        kinds = config.split("/")
        hops = [_pair(kind) for kind in kinds]
        chunks = (count + 1) * (size // CHUNK)
        processes = {
            "receiver": context.Process(target=receiver, args=(kinds[2], hops[2][1], pki, size, count, done)),
            "forwarder b": context.Process(
                target=forwarder, args=(kinds[1], kinds[2], hops[1][1], hops[2][0], pki, chunks)
            ),
            "forwarder a": context.Process(
                target=forwarder, args=(kinds[0], kinds[1], hops[0][1], hops[1][0], pki, chunks)
            ),
            "sender": context.Process(target=sender, args=(kinds[0], hops[0][0], pki, size, count, go)),
        }
        sockets = [end for pair in hops for end in pair]
    for process in processes.values():
        process.start()
    for sock in sockets:
        sock.close()
    try:
        if done.get(timeout=300) != "warm":
            raise RuntimeError("the receiver did not report its warm-up tensor")
        before = {name: cpu_seconds(process.pid) for name, process in processes.items()}
        start = time.monotonic()
        go.set()
        end = done.get(timeout=600)
        after = {name: cpu_seconds(process.pid) for name, process in processes.items()}
    finally:
        for process in processes.values():
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join()
    gb = size * count / 1e9
    cpu = {name: (after[name] - before[name]) / gb for name in processes}
    return {"mb_s": size * count / 1e6 / (end - start), "cpu_s_per_gb": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--total-mib", type=int, default=1024, help="bytes per configuration and round, MiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--out", type=Path, default=Path("bench-results/relay/floor.json"))
    args = parser.parse_args()
    for config in args.configs:
        if config != "hop-tls" and (len(config.split("/")) != 3 or set(config.split("/")) - set(KINDS)):
            parser.error(f"configuration {config!r}: expected hop-tls or three of {KINDS} joined by '/'")
    if "hop-tls" not in args.configs:
        args.configs.insert(0, "hop-tls")
    from nebula_common.pki import init_pki
    from nebula_common.pki.service_identity import ensure_service_certificates

    size = args.size_mib * MIB
    count = max(2, args.total_mib // args.size_mib)
    load_before = load_info()
    rows: dict[str, list[dict[str, Any]]] = {config: [] for config in args.configs}
    with tempfile.TemporaryDirectory(prefix="relay-floor-") as root:
        init_pki(Path(root), ["a", "b"])
        ensure_service_certificates(Path(root), "a")
        for round_ in range(args.rounds):
            for config in args.configs:
                row = run(config, root, size, count)
                rows[config].append(row)
                cpu = "  ".join(f"{name} {value:.2f}" for name, value in row["cpu_s_per_gb"].items())
                print(f"round {round_ + 1} {config:15s} {row['mb_s']:6.0f} MB/s  CPU-s/GB: {cpu}", flush=True)
    load_after = load_info()
    summary: dict[str, Any] = {}
    for config, found in rows.items():
        ratios = [r["mb_s"] / h["mb_s"] for r, h in zip(found, rows["hop-tls"], strict=True)]
        names = found[0]["cpu_s_per_gb"].keys()
        summary[config] = {
            "mb_s": statistics.median(r["mb_s"] for r in found),
            "ratio": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)],
            "cpu_s_per_gb": {n: statistics.median(r["cpu_s_per_gb"][n] for r in found) for n in names},
        }
    print(f"load {load_before} -> {load_after}; {args.size_mib} MiB x {count}, {args.rounds} rounds")
    print("| hops (edge/link/edge) | MB/s | / TLS hop | CPU-s per GB: sender, fwd a, fwd b, receiver | all |")
    print("|---|---|---|---|---|")
    for config, found in summary.items():
        cpu = found["cpu_s_per_gb"]
        order = [cpu.get(n) for n in ("sender", "forwarder a", "forwarder b", "receiver")]
        text = " / ".join(f"{v:.2f}" for v in order if v is not None)
        low, high = found["ratio_range"]
        print(
            f"| {config} | {found['mb_s']:.0f} | {found['ratio']:.2f} ({low:.2f}-{high:.2f}) | {text} "
            f"| {sum(cpu.values()):.2f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": "bench/wan/relay_floor.py " + " ".join(sys.argv[1:]),
                "taken": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                "load_before": load_before,
                "load_after": load_after,
                "rows": rows,
                "median": summary,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
