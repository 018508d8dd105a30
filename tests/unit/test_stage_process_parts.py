"""The parts of a stage process that need no deployment: its channel, the trainer's settings for it,
the board it mirrors into, the sandbox command and the proxy's close detection."""

from __future__ import annotations

import io
import json
import logging
import os
import socket
import struct
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from pydantic import ValidationError

from nebula_common.proto.nebula.v1 import relay_pb2, trainer_pb2
from services.trainer import stage_channel as channel
from services.trainer.config import TrainerSettings
from services.trainer.sandbox import SandboxError, bwrap_command, choose_confinement, stage_environment
from services.trainer.stage_log import MAX_LOG_LINE, LogBudget, relay_log
from services.trainer.stage_proxy import _is_close
from services.trainer.status import StatusBoard


def _pair() -> tuple[Connection, Connection]:
    left, right = socket.socketpair()
    return Connection(left.detach()), Connection(right.detach())


def test_channel_carries_kinds_and_payloads_and_refuses_what_is_not_a_message() -> None:
    ours, theirs = _pair()
    channel.send_json(theirs, channel.STEP, {"elapsed": 0.5, "waited": 0.1, "loss": None})
    kind, payload = channel.receive(ours)
    assert kind == channel.STEP and channel.parse_json(payload)["elapsed"] == 0.5
    theirs.send_bytes(b"")
    with pytest.raises(channel.ChannelError, match="empty message"):
        channel.receive(ours)
    for bad in (b"\xff\xfe", b"[1, 2]"):
        with pytest.raises(channel.ChannelError, match="JSON"):
            channel.parse_json(bad)
    theirs.close()
    with pytest.raises(EOFError):
        channel.receive(ours)


def test_channel_refuses_a_message_past_the_bound() -> None:
    ours, theirs = _pair()
    # A length prefix announcing more than the bound: refused before anything is read into memory.
    raw = socket.socket(fileno=os.dup(theirs.fileno()))
    raw.sendall(struct.pack("!i", channel.MAX_MESSAGE_BYTES + 1))
    with pytest.raises(channel.ChannelError, match="bad message"):
        channel.receive(ours)
    raw.close()


def test_isolation_setting_refuses_an_unknown_mode_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEBULA_TRAINER_STAGE_ISOLATION", "chroot")
    with pytest.raises(ValidationError, match="stage_isolation"):
        TrainerSettings(cluster_id="a", switch_address="127.0.0.1:1", auth_address="127.0.0.1:2")
    with pytest.raises(SandboxError, match="NEBULA_TRAINER_STAGE_ISOLATION='chroot'"):
        choose_confinement("chroot", Path("/tmp"))


def test_process_mode_is_chosen_on_request_and_says_why(tmp_path: Path) -> None:
    chosen = choose_confinement("process", tmp_path)
    assert chosen.mode == "process" and "NEBULA_TRAINER_STAGE_ISOLATION=process" in chosen.describe()


def test_the_sandbox_binds_code_and_the_work_dir_never_the_repository(tmp_path: Path) -> None:
    command = bwrap_command(tmp_path / "work", tmp_path / "sock", [], ["python"])
    binds = [command[i + 1] for i, arg in enumerate(command) if arg in ("--ro-bind", "--bind")]
    repository = Path(__file__).resolve().parents[2]
    assert str(repository / "nebula_common") in binds and str(repository / "services") in binds
    assert str(repository) not in binds  # its runs/ hold PKIs and passwords
    assert str(tmp_path / "work") in binds and "--unshare-all" in command and command[-1] == "python"
    assert set(stage_environment(tmp_path)) == {
        "PATH",
        "HOME",
        "TMPDIR",
        "USER",
        "LANG",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONUNBUFFERED",
    }


def test_a_board_mirror_publishes_statuses_as_they_are_and_listeners_see_them_in_order() -> None:
    source, mirror = StatusBoard("j", "s"), StatusBoard("j", "s")
    seen: list[int] = []
    source.subscribe(mirror.publish)
    mirror.subscribe(lambda status: seen.append(status.steps_done))
    for step in range(1, 4):
        source.update(state=trainer_pb2.STAGE_STATE_RUNNING, steps_done=step, loss=1.0 / step)
    source.update(state=trainer_pb2.STAGE_STATE_SUCCEEDED)
    assert seen == [1, 2, 3, 3]
    assert (
        mirror.latest().state == trainer_pb2.STAGE_STATE_SUCCEEDED
        and mirror.latest().loss == pytest.approx(1 / 3)
    )


def test_the_proxy_recognises_a_stage_close_and_nothing_else() -> None:
    close = relay_pb2.EdgeMessage(close=relay_pb2.EdgeClose(reason="finished")).SerializeToString()
    signal = relay_pb2.EdgeMessage(signal=relay_pb2.EdgeSignal()).SerializeToString()
    assert _is_close(close)
    assert not _is_close(signal) and not _is_close(b"\xff" * 10) and not _is_close(close + b"\x00" * 5000)


def test_stage_log_lines_are_marked_as_the_stages_and_cannot_pass_for_the_trainers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    forged = {"severity": "ERROR", "service": "switch", "logger": "services.trainer.server", "message": "x"}
    lines = [
        json.dumps({"message": "resume exchanged", "epoch": 1, "held": [2, 4], "job_id": "someone-else"}),
        json.dumps(forged),
        "plain text" + "y" * 20_000,
        "",
    ]
    with caplog.at_level(logging.INFO, logger="stage"):
        relay_log(io.BytesIO("\n".join(lines).encode()), "job-1", "encoder")
    records = [(r.name, r.levelname, r.getMessage(), getattr(r, "fields", {})) for r in caplog.records]
    assert [r[0] for r in records] == ["stage"] * 3
    assert records[0][3] == {"epoch": 1, "held": [2, 4], "job_id": "job-1", "stage": "encoder"}
    assert records[1][1] == "ERROR" and records[1][3] == {"job_id": "job-1", "stage": "encoder"}
    assert len(records[2][2]) == MAX_LOG_LINE and records[2][2].startswith("plain text")


def test_a_stage_flooding_its_log_is_held_to_its_budget_and_the_drops_are_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """100,000 lines of 100 bytes written in 10 s (a clock the test moves): what reaches the trainer's
    log is the burst plus 10 s at the sustained rate, and one warning counts what was dropped."""
    now = [0.0]
    budget = LogBudget(rate=1000.0, burst=10_000.0, clock=lambda: now[0])

    def flood() -> Iterator[bytes]:
        for index in range(100_000):
            now[0] = index / 10_000  # 10,000 lines a second
            yield b"x" * 99 + b"\n"
        now[0] = 60.0  # the stage goes quiet, then writes once more
        yield b"after the flood\n"

    class Stream(io.RawIOBase):
        def __iter__(self) -> Iterator[bytes]:
            return flood()

    with caplog.at_level(logging.INFO, logger="stage"):
        relay_log(Stream(), "job-1", "encoder", budget)  # type: ignore[arg-type]
    passed = [r for r in caplog.records if r.getMessage() == "x" * 99]
    # 10,000 bytes of burst + 10 s x 1,000 bytes/s, in lines of 99 bytes (one more for rounding).
    assert 190 <= len(passed) <= 203, len(passed)
    # Said at most every 10 s while it lasts: here once in the flood, once when a line passes after it.
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2, [w.getMessage() for w in warnings]
    counted = [w.fields["dropped_lines"] for w in warnings]  # type: ignore[attr-defined]
    assert sum(counted) == 100_000 - len(passed) and warnings[0].fields["job_id"] == "job-1"  # type: ignore[attr-defined]
    assert caplog.records[-1].getMessage() == "after the flood" and caplog.records[-2] is warnings[-1]


LANDLOCKED = """
import json, os, socket, sys
from pathlib import Path
from services.trainer import landlock
landlock.enforce(json.loads(sys.argv[1]))
seen = {}
def attempt(name, action):
    try:
        action()
        seen[name] = "allowed"
    except OSError as exc:
        seen[name] = exc.errno
attempt("read outside", lambda: Path(sys.argv[2]).read_bytes())
attempt("write outside", lambda: Path(sys.argv[2]).with_name("owned").write_text("x"))
attempt("write work", lambda: Path(sys.argv[3], "out").write_text("x"))
attempt("read work", lambda: Path(sys.argv[3], "out").read_text())
attempt("tcp", lambda: socket.create_connection(("127.0.0.1", 9), timeout=2))
attempt("signal", lambda: os.kill(os.getppid(), 0))
attempt("other /proc", lambda: os.listdir("/proc"))
import nebula_common.proto.nebula.v1.trainer_pb2  # its code stays importable
print(json.dumps(seen))
"""


def test_landlock_keeps_a_stage_to_its_code_and_work_dir(tmp_path: Path) -> None:
    """The rules a landlock-mode stage enforces on itself, enforced for real in a child process."""
    import subprocess
    import sys

    from services.trainer import landlock
    from services.trainer.sandbox import landlock_rules

    if landlock.abi() < 6:
        pytest.skip(f"this kernel's Landlock ABI is {landlock.abi()} (6 needed for this test)")
    secret, work = tmp_path / "pki" / "ca.key", tmp_path / "work"
    secret.parent.mkdir()
    secret.write_text("key")
    work.mkdir()
    rules = landlock_rules(work, [], [])
    repository = Path(__file__).resolve().parents[2]
    assert str(repository) not in rules["read"] and str(repository / "services") in rules["read"]
    done = subprocess.run(
        [sys.executable, "-c", LANDLOCKED, json.dumps(rules), str(secret), str(work)],
        capture_output=True,
        text=True,
        timeout=60,
        env=stage_environment(work, str(work)),
        cwd=work,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen == {
        "read outside": 13,  # EACCES
        "write outside": 13,
        "write work": "allowed",
        "read work": "allowed",
        "tcp": 13,
        "signal": 1,  # EPERM: the trainer is outside the stage's box
        "other /proc": 13,
    }, seen
    assert not (tmp_path / "pki" / "owned").exists()


def test_landlock_mode_is_chosen_on_request_and_named_in_the_description(tmp_path: Path) -> None:
    from services.trainer import landlock

    if landlock.abi() < 1:
        with pytest.raises(SandboxError, match="NEBULA_TRAINER_STAGE_ISOLATION=landlock, but"):
            choose_confinement("landlock", tmp_path)
        return
    chosen = choose_confinement("landlock", tmp_path)
    assert chosen.mode == "landlock" and chosen.landlock_abi == landlock.abi()
    assert chosen.describe().startswith(f"landlock (ABI {landlock.abi()}): reads its code and account only")


FILTERED = """
import ctypes, errno, json, os, subprocess, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS, as stage_main.confine sets it
from services.trainer import seccomp_filter
allowed = seccomp_filter.enforce()
NR = {"ptrace": 101, "keyctl": 250, "bpf": 321, "userfaultfd": 323, "perf_event_open": 298,
      "io_uring_setup": 425, "mount": 165, "unshare": 272, "setns": 308, "init_module": 175,
      "process_vm_readv": 310, "kexec_load": 246, "clone3": 435,
      # Named nowhere in the filter: refused because they are not on the allow list.
      "pkey_alloc": 330, "lookup_dcookie": 212, "memfd_secret": 447, "uselib": 134}
seen = {}
for name, number in NR.items():
    ctypes.set_errno(0)
    result = libc.syscall(number, 0, 0, 0, 0, 0, 0)
    seen[name] = ctypes.get_errno() if result == -1 else "allowed"
CLONE_NEWUSER, SIGCHLD = 0x10000000, 17
ctypes.set_errno(0)
pid = libc.syscall(56, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)  # clone into a new user namespace
seen["clone newuser"] = ctypes.get_errno() if pid == -1 else "allowed"
if pid == 0:
    os._exit(0)
# What a training job does keeps working: threads, a child process, torch.
worker = threading.Thread(target=lambda: None)
worker.start()
worker.join()
child = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True)
seen["subprocess"] = child.stdout.strip()
import torch
seen["torch"] = float(torch.ones(3, 3).matmul(torch.ones(3)).sum())
import socket
def make(family, kind):
    try:
        socket.socket(family, kind).close()
        return "allowed"
    except OSError as exc:
        return exc.errno
SOCKETS = (("udp", socket.AF_INET, socket.SOCK_DGRAM), ("udp6", socket.AF_INET6, socket.SOCK_DGRAM),
           ("packet", socket.AF_PACKET, socket.SOCK_RAW), ("alg", 38, socket.SOCK_SEQPACKET),
           ("tcp", socket.AF_INET, socket.SOCK_STREAM), ("unix", socket.AF_UNIX, socket.SOCK_STREAM),
           ("netlink", socket.AF_NETLINK, socket.SOCK_RAW))
for label, family, kind in SOCKETS:
    seen["socket " + label] = make(family, kind)
seen["allowed"] = allowed
print(json.dumps(seen))
"""


def test_the_seccomp_filter_refuses_what_no_stage_needs_and_keeps_a_job_working(tmp_path: Path) -> None:
    """The filter ``stage_main`` loads, loaded for real in a child: every probed call fails with EPERM,
    those it denies by name and those it never names alike (an allow list), ``clone3`` with ENOSYS (so
    the C library falls back to ``clone``, whose flags it sees), while threads, child processes and
    torch still work."""
    import platform
    import subprocess
    import sys

    from services.trainer import seccomp_filter

    if platform.machine() != "x86_64":
        pytest.skip("the probe uses x86-64 system call numbers")
    if why := seccomp_filter.unavailable():
        pytest.fail(f"seccomp is expected on Linux hosts with libseccomp: {why}")
    done = subprocess.run(
        [sys.executable, "-c", FILTERED],
        capture_output=True,
        text=True,
        timeout=120,
        env=stage_environment(tmp_path),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    eperm = {name: 1 for name in ("ptrace", "keyctl", "bpf", "userfaultfd", "perf_event_open",
                                  "io_uring_setup", "mount", "unshare", "setns", "init_module",
                                  "process_vm_readv", "kexec_load", "clone newuser", "pkey_alloc",
                                  "lookup_dcookie", "memfd_secret", "uselib")}  # fmt: skip
    sockets = {"socket udp": 1, "socket udp6": 1, "socket packet": 1, "socket alg": 1}
    sockets |= {"socket tcp": "allowed", "socket unix": "allowed", "socket netlink": "allowed"}
    assert seen == {
        **eperm,
        **sockets,
        "clone3": 38,
        "subprocess": "42",
        "torch": 9.0,
        "allowed": seen["allowed"],
    }, seen
    assert 300 <= seen["allowed"] <= len(seccomp_filter.allowed()) + 1


def test_every_mode_says_whether_stages_get_the_seccomp_filter(tmp_path: Path) -> None:
    from services.trainer.sandbox import Confinement
    from services.trainer.seccomp_filter import allowed

    chosen = choose_confinement("process", tmp_path)
    assert not chosen.seccomp_missing
    assert f"seccomp allows {len(allowed())} system calls (systemd's @system-service" in chosen.describe()
    missing = Confinement("bwrap", seccomp_missing="seccomp cannot be loaded here: no libseccomp")
    assert "no seccomp filter (seccomp cannot be loaded here: no libseccomp)" in missing.describe()
