"""How fast is the relay? The full data path against the transports it is built from, in ONE run.

Paths, each moving the same tensors (float32, codec ``none``) from a sender to a receiver in
another process on loopback, measured side by side so the ratios share the machine's load:

* ``relay``: edge -> switch a -> mTLS link -> switch b -> edge (four processes: this one sends,
  a spawned process receives; both switches and both auth services are real service processes, their
  internal ports on mutual TLS as in production); the link on the default carrier, sealed records
  (``NEBULA_SWITCH_LINK_CARRIER=records``: after the link's mutual TLS 1.3 handshake each message goes
  as AES-256-GCM records of up to 1 MiB, keyed from the TLS exporter, on the bare TCP connection,
  services/switch/rawlink.py);
* ``relay-grpc``: the same path with the gRPC link carrier (``NEBULA_SWITCH_LINK_CARRIER=grpc``), a
  deployment of its own;
* ``relay-staged``: what ``nebula local up`` gives a job: ``relay``, each stage's edge as records on a
  connection to its switch's edge socket (``services/switch/edge_socket.py``) that its trainer tickets,
  connects and passes to it (``services/trainer/stage_edge_fds.py``, in a process of its own as in the
  trainer);
* ``relay-staged-grpc``: ``relay``, each edge opened by a stage process through its trainer's stage proxy
  (``services/trainer/stage_proxy.py``, a gRPC hop on a Unix socket, in a process of its own as in the
  trainer) and from there to the switch: what a stage gets without an edge socket;
* ``relay-staged-tls``: what Kubernetes gives a job: ``relay-staged`` with the switch's edge socket on a
  TCP port, each connection mutual TLS 1.3 as the trainer and then sealed records
  (``nebula_common/rpc/edge_tls.py``), the stage sealing and opening its own records;
* ``tls``: one Python ``ssl`` TLS 1.3 socket hop (``sendall`` / ``recv_into``);
* ``tcp``: one plain TCP socket hop;
* ``grpc``: one plaintext gRPC stream of 4 MiB ``bytes`` messages (identity serializers);
* ``gloo``: ``torch.distributed`` send/recv over the gloo backend.

Each path sends ``count`` tensors back to back after one warm-up tensor; throughput is bytes over the
time from the first send to the receiver holding the last tensor (``time.monotonic`` is one clock for
every process of the machine). The switches' CPU seconds (user + system, ``/proc/<pid>/stat``) over
the relay run give CPU-seconds per GB relayed.

    make bench-relay           # or: .venv/bin/python bench/wan/relay.py --out bench-results/relay

Writes ``relay.json`` and ``relay.md`` under ``--out``. Never part of ``make test``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import queue
import secrets
import shutil
import signal
import socket
import ssl
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIB = 1 << 20
GRPC_MESSAGE = 4 * MIB
SIZES_MIB = (1, 16, 64)
PATHS = (
    "relay",
    "relay-grpc",
    "relay-staged",
    "relay-staged-grpc",
    "relay-staged-tls",
    "tls",
    "tcp",
    "grpc",
    "gloo",
)
TRANSPORTS = {
    "relay": "records",
    "relay-grpc": "grpc",
    "relay-staged": "records",
    "relay-staged-grpc": "records",
    "relay-staged-tls": "records",
}
"""The link carrier of each relay path (``NEBULA_SWITCH_LINK_CARRIER``)."""
SUFFIX = {
    "relay": "",
    "relay-grpc": "_grpc",
    "relay-staged": "_staged",
    "relay-staged-grpc": "_stagedgrpc",
    "relay-staged-tls": "_stagedtls",
}
STAGED = {"relay-staged": "records", "relay-staged-grpc": "grpc", "relay-staged-tls": "records-tls"}
"""How the stages' edges reach their switch on each staged path: as records on the edge socket (a Unix
socket, or a TCP port with mutual TLS), or through the trainer's stage proxy."""
RECORDS = ("records", "records-tls")
JOB = "bench/relay"
EDGE = "up->down"


def count_for(size_mib: int, total_mib: int) -> int:
    """Tensors per size so each size moves about ``total_mib`` (at least 2 tensors)."""
    return max(2, total_mib // size_mib)


def share_priority(pid: int) -> None:
    """Give a service process this process's scheduling weight.

    Services start in sessions of their own (``start_new_session``), and with the kernel's autogroup
    scheduling each session is one group that competes with every other group at the group's nice,
    whatever its processes' nice. So ``nice -n -15`` on this benchmark (and a ``setsid`` group at
    -15, as the bench lock's runs use) would reach the trainers and the single-hop paths but not the
    switches; this copies this process's autogroup nice to the service's group. Without autogroup, or
    without the permission, the service is left as it is.
    """
    try:
        fields = Path("/proc/self/autogroup").read_text().split()
        nice = int(fields[fields.index("nice") + 1])
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except (OSError, ValueError, IndexError):
        pass


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (0.0 once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ----------------------------------------------------------------------------- receivers (spawned)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("sender closed early")
        got += n


def socket_receiver(port: int, tls: tuple[str, str] | None, size: int, count: int, done: Any) -> None:
    """Accept one connection; receive ``count + 1`` tensors of ``size`` bytes into one reused buffer."""
    import torch

    server = socket.create_server(("127.0.0.1", port))
    context = None
    if tls is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.load_cert_chain(*tls)
    done.put("listening")
    conn, _ = server.accept()
    if context is not None:
        conn = context.wrap_socket(conn, server_side=True)
    buffer = bytearray(size)
    view = memoryview(buffer)
    total = 0.0
    for index in range(count + 1):
        _recv_exact(conn, view)
        total += float(torch.frombuffer(buffer, dtype=torch.float32)[0])
        if index == 0:
            conn.sendall(b"w")  # warm-up received
    done.put(time.monotonic())
    conn.sendall(b"d")
    conn.close()
    server.close()


def grpc_receiver(port: int, size: int, count: int, done: Any) -> None:
    """A plaintext gRPC server: one stream-unary call per tensor of 4 MiB ``bytes`` messages."""
    from concurrent import futures

    import grpc
    import torch

    received = [0]
    buffer = bytearray(size)

    def push(request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        offset = 0
        for message in request_iterator:
            buffer[offset : offset + len(message)] = message
            offset += len(message)
        torch.frombuffer(buffer, dtype=torch.float32)
        received[0] += 1
        if received[0] == count + 1:
            done.put(time.monotonic())
        return b""

    handler = grpc.method_handlers_generic_handler(
        "bench.Sink", {"Push": grpc.stream_unary_rpc_method_handler(push)}
    )
    options = [("grpc.max_receive_message_length", 64 * MIB)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler], options=options)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    done.put("listening")
    server.wait_for_termination(timeout=600)


def gloo_receiver(port: int, size: int, count: int, done: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    tensor = torch.empty(size // 4, dtype=torch.float32)
    for _ in range(count + 1):
        dist.recv(tensor, src=0)
    done.put(time.monotonic())
    dist.send(torch.zeros(1), dst=0)
    dist.destroy_process_group()


def edge_transport(address: str, token: str, job: str, tls: tuple[str, ...] | None) -> Any:
    """The edge transport (gRPC), with the trainer certificate ``tls`` (cluster, ca, cert, key) when the
    switch's ports run internal TLS; ``fds:<path>``: a stage's records transport, its connections asked
    of the trainer process listening at ``path`` (``trainer_fds_process``)."""
    from services.trainer.edge import GrpcEdgeTransport

    if address.startswith("fds:"):
        from services.trainer.edge import RecordsEdgeTransport
        from services.trainer.edge.socket_request import EdgeSocketRequester

        channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        channel.connect(address.removeprefix("fds:"))
        return RecordsEdgeTransport(EdgeSocketRequester(channel), job, EDGE)

    if tls is not None:
        from nebula_common.rpc.internal_tls import ClientTls, trust_endpoint

        trust_endpoint(address, ClientTls(tls[0], Path(tls[1]), Path(tls[2]), Path(tls[3])))
    return GrpcEdgeTransport(address, token, job, EDGE)


def relay_receiver(
    address: str,
    token: str,
    job: str,
    count: int,
    tls: tuple[str, ...] | None,
    window_bytes: int,
    done: Any,
) -> None:
    """The downstream stage: a real edge on switch b receiving ``count + 1`` tensors."""
    from nebula_common.bulk_memory import keep_freed_memory_for_reuse
    from services.trainer.edge import EdgeConnection

    keep_freed_memory_for_reuse()  # as the trainer service does at start

    transport = edge_transport(address, token, job, tls)
    edge = EdgeConnection(
        transport, job_id=job, edge=EDGE, upstream=False, settings=edge_settings(window_bytes)
    )
    for step in range(count + 1):
        edge.receive_tensor(step, 0, timeout=600)
        if step == 0:
            done.put("warm")
            cpu = time.process_time()
    done.put(time.monotonic())
    done.put(time.process_time() - cpu)
    edge.close("finished", timeout=60)


def proxy_process(
    socket_path: str,
    secret: str,
    token: str,
    job: str,
    switch_address: str,
    tls: tuple[str, ...] | None,
    stop: Any,
    done: Any,
) -> None:
    """A trainer's stage proxy for one stage's edge (``relay-staged``), serving until ``stop`` is set."""
    from nebula_common.bulk_memory import keep_freed_memory_for_reuse
    from services.trainer.stage_proxy import StageProxy

    keep_freed_memory_for_reuse()  # as the trainer service does at start
    if tls is not None:
        from nebula_common.rpc.internal_tls import ClientTls, trust_endpoint

        trust_endpoint(switch_address, ClientTls(tls[0], Path(tls[1]), Path(tls[2]), Path(tls[3])))
    proxy = StageProxy(
        socket_path,
        secret=secret,
        token=lambda: token,
        job_id=job,
        edges={EDGE},
        switch_address=switch_address,
        data_address=None,
        dataset="",
    )
    proxy.start()
    done.put("ready")
    stop.wait()
    proxy.stop()


def trainer_fds_process(
    listen: str,
    token: str,
    job: str,
    switch_address: str,
    tls: tuple[str, ...] | None,
    edge_socket: str,
    stop: Any,
    done: Any,
) -> None:
    """A trainer's side of its stage's edge connections (``relay-staged``): each stage that connects to
    ``listen`` (a ``SOCK_SEQPACKET`` socket, standing for the pair the trainer makes at a stage's start)
    is answered by a ``StageEdgeFds`` with tickets from the switch, until ``stop`` is set."""
    from services.trainer.stage_edge_fds import StageEdgeFds
    from services.trainer.stage_proxy import StageProxy

    identity = None
    if tls is not None:
        from nebula_common.rpc.internal_tls import ClientTls, trust_endpoint

        identity = ClientTls(tls[0], Path(tls[1]), Path(tls[2]), Path(tls[3]))
        trust_endpoint(switch_address, identity)
    proxy = StageProxy(
        str(Path(listen).with_suffix(".proxy")),
        secret=secrets.token_urlsafe(24),
        token=lambda: token,
        job_id=job,
        edges={EDGE},
        switch_address=switch_address,
        data_address=None,
        dataset="",
    )
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(listen)
    listener.listen(4)
    listener.settimeout(0.2)
    done.put("ready")
    answering = []
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        fds = StageEdgeFds(conn, proxy, edge_socket, job, tls=identity)
        fds.start()
        answering.append(fds)
    for fds in answering:
        fds.stop()
    proxy.stop()


def edge_settings(window_bytes: int) -> Any:
    """The trainers' edge settings: the product's defaults, or its credit window set to ``window_bytes``
    (``NEBULA_TRAINER_EDGE_WINDOW_BYTES`` in the trainer service)."""
    from services.trainer.edge import EdgeSettings

    return EdgeSettings(window_bytes=window_bytes) if window_bytes else EdgeSettings()


# ----------------------------------------------------------------------------- senders (this process)


@dataclass
class Timed:
    seconds: float
    bytes: int

    @property
    def mb_s(self) -> float:
        return self.bytes / 1e6 / self.seconds


def _spawn(target: Callable[..., None], *args: Any) -> tuple[Any, Any]:
    context = mp.get_context("spawn")
    done = context.Queue()
    process = context.Process(target=target, args=(*args, done), daemon=True)
    process.start()
    return process, done


def _get(done: Any, process: Any, timeout: float) -> Any:
    """The receiver's next report; fails at once (not after ``timeout``) if the receiver died."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return done.get(timeout=1.0)
        except queue.Empty:
            if not process.is_alive():
                raise RuntimeError(
                    f"the receiver died (exit code {process.exitcode}); see its error above"
                ) from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"the receiver reported nothing in {timeout:.0f} s") from None


def _expect(done: Any, value: str, process: Any, timeout: float = 120) -> None:
    got = _get(done, process, timeout)
    if got != value:
        raise RuntimeError(f"receiver said {got!r}, expected {value!r} (alive: {process.is_alive()})")


def _finish(process: Any, timeout: float = 60) -> None:
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()


def bench_socket(tensor: Any, count: int, tls: tuple[str, str] | None) -> Timed:
    size = tensor.numel() * 4
    port = free_port()
    process, done = _spawn(socket_receiver, port, tls, size, count)
    try:
        _expect(done, "listening", process)
        sock = socket.create_connection(("127.0.0.1", port))
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.minimum_version = ssl.TLSVersion.TLSv1_3
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE  # the cost measured is the encryption, not the check
            sock = context.wrap_socket(sock)
        payload = memoryview(tensor.numpy()).cast("B")
        sock.sendall(payload)
        if sock.recv(1) != b"w":
            raise RuntimeError("no warm-up acknowledgement")
        start = time.monotonic()
        for _ in range(count):
            sock.sendall(payload)
        end = _get(done, process, 600)
        sock.recv(1)
        sock.close()
        return Timed(end - start, size * count)
    finally:
        _finish(process)


def bench_grpc(tensor: Any, count: int) -> Timed:
    import grpc

    size = tensor.numel() * 4
    port = free_port()
    process, done = _spawn(grpc_receiver, port, size, count)
    try:
        _expect(done, "listening", process)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            push = channel.stream_unary("/bench.Sink/Push")

            def messages() -> Iterator[bytes]:
                data = tensor.numpy().tobytes()  # the sender's one copy into bytes, as a real client
                for offset in range(0, size, GRPC_MESSAGE):
                    yield data[offset : offset + GRPC_MESSAGE]

            push(messages(), timeout=600)
            start = time.monotonic()
            for _ in range(count):
                push(messages(), timeout=600)
            end = _get(done, process, 600)
        return Timed(end - start, size * count)
    finally:
        process.kill()
        process.join()


def bench_gloo(tensor: Any, count: int) -> Timed:
    import torch
    import torch.distributed as dist

    size = tensor.numel() * 4
    port = free_port()
    process, done = _spawn(gloo_receiver, port, size, count)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
        dist.send(tensor, dst=1)
        start = time.monotonic()
        for _ in range(count):
            dist.send(tensor, dst=1)
        end = _get(done, process, 600)
        dist.recv(torch.zeros(1), src=1)
        dist.destroy_process_group()
        return Timed(end - start, size * count)
    finally:
        _finish(process)


class Deployment:
    """Two clusters' auth services and switches as real service processes; switch a dials b."""

    def __init__(
        self,
        root: Path,
        transport: str = "records",
        internal_tls: bool = True,
        staged: str = "",
    ) -> None:
        self.root = root
        #: How each stage's edge reaches its switch (``STAGED``): ``records`` (the edge socket, through a
        #: trainer process's passed connections), ``grpc`` (a stage proxy process); empty: not staged.
        self.staged = staged
        self.transport = transport
        self.internal_tls = internal_tls
        #: Per cluster (cluster, ca, cert, key) of the trainer identity (internal TLS on).
        self.trainer_tls: dict[str, tuple[str, ...]] = {}
        self.processes: list[Any] = []
        self.switches: dict[str, Any] = {}
        self.tokens: dict[str, str] = {}
        self._edge_ports: dict[str, int] = {}

    def start(self) -> Deployment:
        """Start every process; a failure stops those already started (none is left behind)."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> Deployment:
        # This bench measures the switch's WAN path; its internal ports run plaintext under the
        # explicit development flag (the services and this process's clients inherit it).
        os.environ["NEBULA_INTERNAL_PLAINTEXT"] = "1"
        from nebula_common.launcher.process import ServiceProcess, console_command, wait_healthy
        from nebula_common.pki import init_pki
        from nebula_common.ports import service_port
        from nebula_common.sdk.auth_client import AuthClient

        pki = init_pki(self.root / "pki", ["a", "b"])
        tls_dirs: dict[str, dict[str, str]] = {}
        if self.internal_tls:
            # every service and the trainers get identities
            from nebula_common.pki.service_identity import (
                ServiceTlsFiles,
                ensure_service_certificates,
                service_tls_dir,
            )
            from nebula_common.rpc.internal_tls import ClientTls, trust_endpoint

            for cluster in "ab":
                ensure_service_certificates(self.root / "pki", cluster)
                tls_dirs[cluster] = {
                    service: str(service_tls_dir(self.root / "pki", cluster, service))
                    for service in ("auth", "switch", "trainer")
                }
                files = ServiceTlsFiles.in_dir(Path(tls_dirs[cluster]["trainer"]))
                self.trainer_tls[cluster] = (cluster, str(files.ca), str(files.cert), str(files.key))
        logs = self.root / "logs"
        logs.mkdir(parents=True, exist_ok=True)

        def launch(name: str, module: str, prefix: str, env: dict[str, str]) -> Any:
            process = ServiceProcess(
                name=name,
                command=console_command(module),
                env={prefix + k: v for k, v in env.items()},
                log_dir=logs,
            )
            process.start()
            self.processes.append(process)
            if process.pid is not None:
                share_priority(process.pid)
            process.wait_ready(120)
            return process

        auth_addresses = {}
        service_auth = {}
        for cluster in "ab":
            password = secrets.token_urlsafe(18)
            (self.root / cluster).mkdir(parents=True, exist_ok=True)
            password_file = self.root / cluster / "admin-password"
            password_file.write_text(password)
            auth = launch(
                f"auth-{cluster}",
                "services.auth",
                "NEBULA_AUTH_",
                {
                    "CLUSTER_ID": cluster,
                    "DATA_DIR": str(self.root / cluster / "auth"),
                    "ADMIN_PASSWORD_FILE": str(password_file),
                    "LISTEN": f"127.0.0.1:{service_port()}",
                    "METRICS_PORT": "-1",
                    "LOG_LEVEL": "WARNING",
                    **({"INTERNAL_TLS_DIR": tls_dirs[cluster]["auth"]} if tls_dirs else {}),
                },
            )
            auth_addresses[cluster] = f"127.0.0.1:{auth.info['grpc_port']}"
            # Services call auth's service port (mutual TLS) when internal TLS is on.
            service_auth[cluster] = (
                f"127.0.0.1:{auth.info['service_port']}" if tls_dirs else auth_addresses[cluster]
            )
            if tls_dirs:
                trainer = self.trainer_tls[cluster]
                tls = ClientTls(cluster, Path(trainer[1]), Path(trainer[2]), Path(trainer[3]))
                trust_endpoint(auth_addresses[cluster], tls)
            wait_healthy(auth_addresses[cluster], "nebula.v1.Auth")
            with AuthClient(auth_addresses[cluster]) as client:
                self.tokens[cluster] = client.login("admin", password).token
        wan_b = service_port()
        for cluster, peer in (("b", "a"), ("a", "b")):
            paths = pki.cluster(cluster)
            env = {
                "CLUSTER_ID": cluster,
                "PEER_CLUSTER_ID": peer,
                "TLS_CERT": str(paths.switch_cert),
                "TLS_KEY": str(paths.switch_key),
                "TRUST_BUNDLE": str(paths.trust_bundle),
                "AUTH_ADDRESS": service_auth[cluster],
                "DATA_DIR": str(self.root / cluster / "switch"),
                "INTERNAL_LISTEN": f"127.0.0.1:{service_port()}",
                "WAN_LISTEN": f"127.0.0.1:{wan_b if cluster == 'b' else service_port()}",
                "METRICS_PORT": str(service_port()),
                "LOG_LEVEL": "WARNING",
                "LINK_ROLE": "accept" if cluster == "b" else "dial",
                "LINK_CARRIER": self.transport,
                **({"INTERNAL_TLS_DIR": tls_dirs[cluster]["switch"]} if tls_dirs else {}),
                **({"EDGE_SOCKET": self.edge_socket(cluster)} if self.staged in RECORDS else {}),
            }
            if cluster == "a":
                env["PEER_ADDRESS"] = f"127.0.0.1:{wan_b}"
            self.switches[cluster] = launch(f"switch-{cluster}", "services.switch", "NEBULA_SWITCH_", env)
        self.tls_pair = (str(pki.cluster("b").switch_cert), str(pki.cluster("b").switch_key))
        return self

    def internal(self, cluster: str) -> str:
        """Where trainers open edges: the internal port, or with internal TLS the service port."""
        port = "service_port" if self.internal_tls else "internal_port"
        return f"127.0.0.1:{self.switches[cluster].info[port]}"

    def edge_socket(self, cluster: str) -> str:
        """Where switch ``cluster`` serves its edge socket (``relay-staged``, ``relay-staged-tls``)."""
        if self.staged == "records-tls":
            from nebula_common.ports import service_port

            return f"127.0.0.1:{self._edge_ports.setdefault(cluster, service_port())}"
        directory = self.root / cluster / "edges"
        directory.mkdir(parents=True, exist_ok=True)
        return str(directory / "switch.sock")

    def tls(self, cluster: str) -> tuple[str, ...] | None:
        return self.trainer_tls.get(cluster)

    def link_connections(self) -> dict[str, float]:
        """``nebula_switch_link_connections`` of each switch right now (from its metrics endpoint)."""
        from nebula_common.metrics import metrics_url, read_metrics, trust_metrics_endpoint
        from nebula_common.pki.service_identity import MONITORING_ROLE, ServiceTlsFiles, service_tls_dir

        found = {}
        for cluster, process in self.switches.items():
            url = metrics_url("127.0.0.1", process.info)
            if url is None:
                continue
            if url.startswith("https:"):  # read as the cluster's Prometheus would
                scraper = ServiceTlsFiles.in_dir(service_tls_dir(self.root / "pki", cluster, MONITORING_ROLE))
                address = f"127.0.0.1:{process.info['metrics_port']}"
                trust_metrics_endpoint(address, scraper, cluster, "switch")
            for line in read_metrics(url).splitlines():
                # One series per peer (label ``peer``).
                if line.startswith("nebula_switch_link_connections") and " " in line:
                    found[cluster] = found.get(cluster, 0.0) + float(line.split()[-1])
        return found

    def link_transport(self) -> dict[str, str]:
        """What carried each switch's last link session (its audit log's last ``link.up`` record)."""
        found = {}
        for cluster in self.switches:
            path = self.root / cluster / "switch" / "audit.log"
            for line in path.read_text().splitlines() if path.exists() else []:
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if record.get("event") == "link.up":
                        found[cluster] = str((record.get("details") or {}).get("transport", "grpc"))
        return found

    def switch_cpu(self) -> dict[str, float]:
        return {c: cpu_seconds(p.pid) for c, p in self.switches.items()}

    def stop(self) -> None:
        for process in reversed(self.processes):
            with contextlib.suppress(Exception):
                process.stop()


class Proxies:
    """A staged path's trainer side: one process per side between the stage's edge and its switch (a
    stage proxy for ``relay-staged-grpc``, a ``StageEdgeFds`` server for ``relay-staged``)."""

    def __init__(self, deployment: Deployment, job: str) -> None:
        context = mp.get_context("spawn")
        self.stop = context.Event()
        self.processes: dict[str, Any] = {}
        self.addresses: dict[str, tuple[str, str]] = {}  # side -> (unix address, the stage's secret)
        for side in ("a", "b"):
            directory = deployment.root / f"{side}-stage-{job.rsplit('-', 1)[-1]}"
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            secret = secrets.token_urlsafe(24)
            done = context.Queue()
            if deployment.staged in RECORDS:
                target: Callable[..., None] = trainer_fds_process
                args: tuple[Any, ...] = (str(directory / "fds.sock"), deployment.tokens[side], job)
                args += (deployment.internal(side), deployment.tls(side), deployment.edge_socket(side))
                self.addresses[side] = (f"fds:{directory / 'fds.sock'}", "")
            else:
                target = proxy_process
                args = (str(directory / "edge.sock"), secret, deployment.tokens[side], job)
                args += (deployment.internal(side), deployment.tls(side))
                self.addresses[side] = (f"unix:{directory / 'edge.sock'}", secret)
            process = context.Process(target=target, args=(*args, self.stop, done), daemon=True)
            process.start()
            _expect(done, "ready", process)
            self.processes[side] = process
        self.role = "trainer" if deployment.staged in RECORDS else "proxy"

    def cpu(self) -> dict[str, float]:
        return {f"{self.role} {side}": cpu_seconds(p.pid) for side, p in self.processes.items()}

    def close(self) -> None:
        self.stop.set()
        for process in self.processes.values():
            _finish(process)


def bench_relay(
    deployment: Deployment, tensor: Any, count: int, job_index: int, window_bytes: int = 0
) -> tuple[Timed, dict[str, float]]:
    from services.trainer.edge import EdgeConnection

    job = f"{JOB}-{job_index}"
    size = tensor.numel() * 4
    proxies = Proxies(deployment, job) if deployment.staged else None
    if proxies is not None:  # the stages reach only their proxies: a Unix socket, the stage's secret
        (address_a, token_a), (address_b, token_b) = proxies.addresses["a"], proxies.addresses["b"]
        tls_a = tls_b = None
    else:
        address_a, token_a, tls_a = deployment.internal("a"), deployment.tokens["a"], deployment.tls("a")
        address_b, token_b, tls_b = deployment.internal("b"), deployment.tokens["b"], deployment.tls("b")
    process, done = _spawn(relay_receiver, address_b, token_b, job, count, tls_b, window_bytes)
    edge = None
    try:
        transport = edge_transport(address_a, token_a, job, tls_a)
        edge = EdgeConnection(
            transport, job_id=job, edge=EDGE, upstream=True, settings=edge_settings(window_bytes)
        )
        edge.send_tensor(tensor, 0, 0)
        _expect(done, "warm", process, timeout=300)
        before = {**deployment.switch_cpu(), **(proxies.cpu() if proxies else {})}
        sender_cpu = time.process_time()
        start = time.monotonic()
        for step in range(1, count + 1):
            edge.send_tensor(tensor, step, 0)
        end = _get(done, process, 600)
        after = {**deployment.switch_cpu(), **(proxies.cpu() if proxies else {})}
        cpu = {c: after[c] - before[c] for c in after}
        cpu["sender"] = time.process_time() - sender_cpu
        cpu["receiver"] = _get(done, process, 60)
        edge.close("finished", timeout=60)
        return Timed(end - start, size * count), cpu
    finally:
        if edge is not None:
            edge.abort("benchmark ended")
        _finish(process)
        if proxies is not None:
            proxies.close()


# ----------------------------------------------------------------------------- report


def load_info() -> dict[str, float]:
    one, five, fifteen = os.getloadavg()
    return {"loadavg_1m": round(one, 2), "loadavg_5m": round(five, 2), "loadavg_15m": round(fifteen, 2)}


def render(result: dict[str, Any]) -> str:
    lines = [
        "# Relay throughput: the full path against single hops (one run, same load)",
        "",
        f"Command: `{result['command']}`  ",
        f"Taken {result['taken']}; load before {result['load_before']}, after {result['load_after']}; "
        f"{os.cpu_count()} cores.",
        "",
        "MB/s (10^6 bytes per second), receiver holding the last tensor; ratio = the path / the TLS hop "
        "in the same round. Relay paths: 'relay' has the default link carrier between the switches (sealed "
        "records, rawlink.py), 'relay-grpc' a gRPC link; their edges are gRPC streams on the switches' "
        "mutual-TLS internal ports, as in production; 'relay-staged' is what `nebula local up` gives a job "
        "(each edge from a stage process as records on the switch's edge socket, on connections its "
        "trainer passes it), 'relay-staged-tls' what Kubernetes gives (the same on the switch's TCP edge "
        "port: mutual TLS, then sealed records), 'relay-staged-grpc' a stage's edge through its trainer's "
        "stage proxy. "
        "With several rounds (the paths take turns each round) MB/s are medians and the ratio is "
        "theirs, followed by the range of the per-round ratios. CPU-s per GB: user + system CPU of each "
        "process over the run, per 10^9 payload bytes; whole path: all of them together (the data plane's "
        "target for the default path is at most 2.5).",
        "",
        "| tensor | path | MB/s | / TLS hop | switches' CPU-s per GB | CPU-s per GB of each process "
        "| whole path |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        mb = row["mb_s"]
        gb = row["size_mib"] * MIB * row["count"] * row.get("repeat", 1) / 1e9
        rounds = f", {row['repeat']} rounds" if row.get("repeat", 1) > 1 else ""
        for path, value in mb.items():
            ratio = "-"
            if "tls" in mb and path != "tls":
                each = row.get("ratio_rounds", {}).get(path)
                spread = f" ({min(each):.2f}-{max(each):.2f})" if each else ""
                ratio = f"{value / mb['tls']:.2f}{spread}"
            suffix = SUFFIX.get(path)
            switches = row.get("switch_cpu_s_per_gb" + suffix) if suffix is not None else None
            split = row.get("cpu_s" + suffix, {}) if suffix is not None else {}
            parts = ", ".join(f"{name} {seconds / gb:.2f}" for name, seconds in split.items())
            whole = f"{sum(split.values()) / gb:.2f}" if split else "-"
            lines.append(
                f"| {row['size_mib']} MiB x {row['count']}{rounds} | {path} | {value:.0f} | {ratio} "
                f"| {f'{switches:.2f}' if switches is not None else '-'} | {parts or '-'} | {whole} |"
            )
    return "\n".join([*lines, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/relay"))
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES_MIB), help="tensor sizes, MiB")
    parser.add_argument("--total-mib", type=int, default=256, help="bytes moved per size and path, MiB")
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument("--name", default="relay", help="file stem of the JSON and markdown")
    parser.add_argument(
        "--window-mib",
        type=int,
        default=0,
        help="credit window of the relay paths, MiB: the switches' NEBULA_SWITCH_MAX_WINDOW_BYTES and both "
        "trainers' edge window (NEBULA_TRAINER_EDGE_WINDOW_BYTES); 0: the product defaults (16 MiB)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds per size: the paths take turns each round; MB/s are the medians over the rounds",
    )
    args = parser.parse_args()
    if args.window_mib < 0 or args.window_mib > 1024:
        parser.error(f"--window-mib {args.window_mib}: expected 0 (the defaults) or 1 to 1024 MiB")

    import torch

    from nebula_common.bulk_memory import keep_freed_memory_for_reuse

    if any(path in TRANSPORTS for path in args.paths):
        keep_freed_memory_for_reuse()  # this process is the sending trainer (as the trainer service does)
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "command": "make bench-relay  # .venv/bin/python bench/wan/relay.py "
        + " ".join(
            [
                "--sizes",
                *map(str, args.sizes),
                "--total-mib",
                str(args.total_mib),
                "--repeat",
                str(args.repeat),
                "--paths",
                *args.paths,
                *(["--window-mib", str(args.window_mib)] if args.window_mib else []),
            ]
        ),
        "taken": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "load_before": load_info(),
        "rows": [],
    }
    window_bytes = args.window_mib << 20
    if window_bytes:
        os.environ["NEBULA_SWITCH_MAX_WINDOW_BYTES"] = str(window_bytes)  # inherited by the switches
    root = Path(tempfile.mkdtemp(prefix="nebula-bench-relay-"))
    deployments: dict[str, Deployment] = {}
    try:
        for path, transport in TRANSPORTS.items():
            if path in args.paths:
                deployments[path] = Deployment(
                    root / path,
                    transport,
                    staged=STAGED.get(path, ""),
                ).start()
                print(f"deployment up ({path}: {transport} link)", flush=True)
        tls_pair = next(iter(deployments.values())).tls_pair if deployments else None
        if tls_pair is None:
            from nebula_common.pki import init_pki

            paths = init_pki(root / "pki-tls", ["a", "b"]).cluster("b")
            tls_pair = (str(paths.switch_cert), str(paths.switch_key))
        for index, size_mib in enumerate(args.sizes):
            count = count_for(size_mib, args.total_mib)
            tensor = torch.randn(size_mib * MIB // 4)
            row: dict[str, Any] = {"size_mib": size_mib, "count": count, "repeat": args.repeat, "mb_s": {}}
            rounds: dict[str, list[float]] = {path: [] for path in args.paths}
            for repeat in range(args.repeat):  # the paths take turns, so every round shares the load
                for path in args.paths:
                    if path in deployments:
                        deployment = deployments[path]
                        timed, cpu = bench_relay(
                            deployment, tensor, count, index * 1000 + repeat, window_bytes
                        )
                        suffix = SUFFIX[path]
                        total = row.setdefault("cpu_s" + suffix, {})
                        for key, value in cpu.items():
                            total[key] = round(total.get(key, 0.0) + value, 2)
                        relayed_gb = timed.bytes * (repeat + 1) / 1e9
                        row["switch_cpu_s_per_gb" + suffix] = (total["a"] + total["b"]) / relayed_gb
                        row["link_connections_after" + suffix] = deployment.link_connections()
                        row["link_transport" + suffix] = deployment.link_transport()
                        print(f"  CPU s: {cpu}; transport {row['link_transport' + suffix]}", flush=True)
                    elif path == "tls":
                        timed = bench_socket(tensor, count, tls_pair)
                    elif path == "tcp":
                        timed = bench_socket(tensor, count, None)
                    elif path == "grpc":
                        timed = bench_grpc(tensor, count)
                    else:
                        timed = bench_gloo(tensor, count)
                    rounds[path].append(round(timed.mb_s, 1))
                    print(
                        f"{size_mib} MiB x {count} {path} (round {repeat + 1}): {timed.mb_s:.0f} MB/s",
                        flush=True,
                    )
            row["mb_s"] = {path: statistics.median(values) for path, values in rounds.items()}
            if args.repeat > 1:
                row["mb_s_rounds"] = rounds
                if "tls" in rounds:
                    row["ratio_rounds"] = {
                        path: [
                            round(mb / tls, 2) for mb, tls in zip(rounds[path], rounds["tls"], strict=True)
                        ]
                        for path in TRANSPORTS
                        if path in rounds
                    }
            result["rows"].append(row)
    finally:
        for deployment in deployments.values():
            deployment.stop()
        shutil.rmtree(root, ignore_errors=True)
    result["load_after"] = load_info()
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{args.name}.md").write_text(render(result))
    print(render(result))


if __name__ == "__main__":
    threading.current_thread().name = "bench-relay"
    # A SIGTERM (``timeout``, a closed terminal's job control) ends the run through ``main``'s cleanup, so
    # the deployments' services are stopped instead of left holding their ports.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    main()
