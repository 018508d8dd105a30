"""The hostile half of ``tests/integration/test_security_hostile_stage.py``: appended to a stage module.

Run inside a stage process by the module's ``build()``; every attempt records whether it succeeded
(it must not) and what it saw, into ``probe-<job>.json`` in the stage's working directory.
"""

import ctypes
import gc
import json
import os
import platform
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.rpc.edge_records import parse_status_record
from nebula_common.rpc.framing import LINK_FRAMING_VERSION

found: dict[str, dict[str, Any]] = {}
PTRACE_ATTACH = 16
CLONE_NEWUSER = 0x10000000
KEYCTL = {"x86_64": 250, "aarch64": 219}
WATCHWORDS = ("NEBULA", "KEY", "TOKEN", "PASSWORD", "SECRET")
FOREIGN_METHODS = (
    "/nebula.v1.Trainer/ListStages",
    "/nebula.v1.Trainer/CancelStage",
    "/nebula.v1.Auth/ListAccounts",
    "/nebula.v1.Data/ReadBatch",
    "/nebula.v1.Data/DownloadDataset",
)


def attempt(name: str, action: Callable[[], object]) -> None:
    try:
        result = action()
    except BaseException as exc:  # refused: what we want to see
        found[name] = {"succeeded": False, "detail": f"{type(exc).__name__}: {exc}"[:300]}
        return
    found[name] = {"succeeded": True, "detail": str(result)[:300]}


def read(path: str) -> object:
    target = Path(path)
    return target.read_bytes()[:16] if target.is_file() else os.listdir(target)


def ptrace(pid: int) -> str:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.ptrace(PTRACE_ATTACH, pid, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "ptrace refused")
    return "attached"


def kernel(call: str) -> str:
    """A system call the stage's seccomp filter refuses, which would succeed without it."""
    libc = ctypes.CDLL(None, use_errno=True)
    if call == "unshare a user namespace":
        result = libc.unshare(CLONE_NEWUSER)
    else:  # KEYCTL_GET_KEYRING_ID of the session keyring (KEY_SPEC_SESSION_KEYRING, create it)
        result = libc.syscall(KEYCTL[platform.machine()], 0, -3, 1)
    if result == -1:
        raise OSError(ctypes.get_errno(), f"{call} refused")
    return f"{call}: {result}"


def send_udp() -> None:
    """A datagram to this host's discard port: no way out for a stage (Landlock covers UDP only from
    ABI 10; the seccomp filter refuses the socket)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.sendto(b"nebula", ("127.0.0.1", 9))


def connect(address: str) -> None:
    host, port = address.rsplit(":", 1)
    socket.create_connection((host, int(port)), timeout=2).close()


def forged_ticket(path: str) -> str:
    """An edge on the switch's edge socket with a made-up ticket as its first record (the socket's path
    is in the trainer's container under Landlock): the switch must refuse it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        ticket = os.urandom(32)
        sock.sendall(len(ticket).to_bytes(4, "big") + ticket)
        header = sock.recv(4, socket.MSG_WAITALL)
        record = sock.recv(int.from_bytes(header, "big"), socket.MSG_WAITALL) if len(header) == 4 else b""
    if not record:
        raise ConnectionError("closed without an answer")
    status = parse_status_record(record)
    if status is not None:
        raise PermissionError(f"refused: {status[0].name}: {status[1]}")
    return f"answered with a record that is no status: {record[:40]!r}"


def probe(options: dict[str, Any]) -> None:
    trainer = int(options["trainer_pid"])
    for path in options["secrets"]:
        attempt(f"read {path}", lambda p=path: read(p))
    leaked = [k for k in os.environ if any(w in k.upper() for w in WATCHWORDS)]
    found["environment"] = {"succeeded": bool(leaked), "detail": ",".join(sorted(os.environ))}
    try:
        pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    except OSError as exc:  # Landlock: no /proc but its own
        pids, exc_seen = [], f"{type(exc).__name__}: {exc}"
    else:
        exc_seen = ""
    found["trainer visible in /proc"] = {"succeeded": trainer in pids, "detail": exc_seen or str(pids)}
    for what in ("environ", "mem", "maps"):
        attempt(f"/proc/trainer/{what}", lambda w=what: Path(f"/proc/{trainer}/{w}").read_bytes()[:16])
    attempt("ptrace the trainer", lambda: ptrace(trainer))
    for call in ("unshare a user namespace", "keyctl the session keyring"):
        attempt(call, lambda c=call: kernel(c))
    for name, address in options["ports"].items():
        attempt(f"connect {name}", lambda a=address: connect(a))
    attempt("send UDP", send_udp)
    if options.get("edge_socket"):
        attempt("open an edge with a forged ticket", lambda: forged_ticket(options["edge_socket"]))
    # The stage's secret for its proxy is in its own memory; an attacker finds it there.
    runner = next(o for o in gc.get_objects() if type(o).__name__ == "ProgramRunner")
    channel = grpc.insecure_channel(runner.switch_address)
    meta = (("authorization", "Bearer " + runner.token),)
    found["stage secret found in memory"] = {"succeeded": True, "detail": runner.switch_address}

    def other_edge() -> object:
        opened = relay_pb2.EdgeMessage(
            open=relay_pb2.EdgeOpen(
                job_id=options["victim_job"], edge="encoder->decoder", link_framing=LINK_FRAMING_VERSION
            )
        )
        call = channel.stream_stream("/nebula.v1.Relay/OpenEdge")(
            iter([opened.SerializeToString()]), metadata=meta, timeout=10
        )
        return list(call)

    attempt("open another job's edge", other_edge)
    for method in FOREIGN_METHODS:
        attempt(f"call {method}", lambda m=method: channel.unary_unary(m)(b"", metadata=meta, timeout=10))
    for target in options["writes"]:
        attempt(f"write {target}", lambda t=target: Path(t).write_text("owned"))
    Path(os.getcwd(), f"probe-{options['job']}.json").write_text(json.dumps(found))
