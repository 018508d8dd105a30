"""A service in its bubblewrap box: it sees only what its box names, is signalled itself, and heals.

Real bubblewrap (skipped where it cannot create namespaces, failed instead under
``NEBULA_REQUIRE_BWRAP=1``, as in CI): the boxed process reads its own file and not a secret beside
it, sees no other process, makes no system call the services' seccomp filter denies, drains on SIGTERM
with its own exit code, reports a SIGKILL as a signal (bubblewrap's 128 + n is translated), and the
supervisor restarts it after a kill. The launcher keeps a
copy of the cluster's CRL in each service's own directory, the one part of the PKI its box shows.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from nebula_common.launcher import process
from nebula_common.launcher.process import ServiceProcess, ServiceStartError
from nebula_common.launcher.renewal import LeafRenewer
from nebula_common.launcher.service_box import REQUIRE_ENV, ServiceBox, filter_missing, unavailable
from nebula_common.launcher.supervisor import RestartPolicy, Supervisor, describe_exit
from nebula_common.pki import init_pki
from nebula_common.pki.lifecycle import revoke_certificate
from nebula_common.pki.service_identity import ensure_service_certificates, mirror_crl
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(120)

SERVICE = """
import ctypes, json, os, signal, socket, sys, time
from pathlib import Path
def readable(path):
    try:
        return Path(path).read_text()
    except OSError as exc:
        return exc.strerror
libc = ctypes.CDLL(None, use_errno=True)
def call(name, *args):
    ctypes.set_errno(0)
    return os.strerror(ctypes.get_errno()) if getattr(libc, name)(*args) == -1 else "allowed"
def open_socket(family, kind):
    try:
        socket.socket(family, kind).close()
        return "allowed"
    except OSError as exc:
        return exc.strerror
signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
report = {
    "seccomp": [l.split()[1] for l in open("/proc/self/status") if l.startswith("Seccomp:")],
    "refused": {
        "unshare": call("unshare", 0x10000000),
        "ptrace": call("ptrace", 0, 0, 0, 0),
        "keyctl": call("syscall", 250, 0, -3, 0),
        "bpf": call("syscall", 321, 0, 0, 0),
        "raw socket": open_socket(socket.AF_INET, socket.SOCK_RAW),
        "packet socket": open_socket(17, socket.SOCK_RAW),
    },
    "udp socket": open_socket(socket.AF_INET, socket.SOCK_DGRAM),
    "grpc_port": 1,
    "own": readable(sys.argv[1]),
    "hidden": readable(sys.argv[2]),
    "beside": readable(sys.argv[3]),
    "pids": sorted(p for p in os.listdir("/proc") if p.isdigit()),
    "pid": os.getpid(),
}
print(json.dumps(report), flush=True)
time.sleep(600)
"""


@pytest.fixture
def boxed(tmp_path: Path) -> ServiceProcess:
    if unavailable() and os.environ.get(REQUIRE_ENV) != "1":
        pytest.skip(f"no service boxes here: {unavailable()}")
    shared = tmp_path / "pki"
    (shared / "mine").mkdir(parents=True)
    (shared / "mine" / "service.key").write_text("mine")
    (shared / "ca.key").write_text("the CA's")
    (tmp_path / "beside.key").write_text("another service's")
    box = ServiceBox(read_only=(shared,), read_write=(tmp_path / "state",), hidden=(shared / "ca.key",))
    command = [
        sys.executable,
        "-c",
        SERVICE,
        str(shared / "mine" / "service.key"),
        str(shared / "ca.key"),
        str(tmp_path / "beside.key"),
    ]
    logs = tmp_path / "logs"
    logs.mkdir()
    return ServiceProcess(name="boxed", command=command, env={}, log_dir=logs, box=box)


def test_a_boxed_service_reads_its_own_file_only_and_drains_on_sigterm(boxed: ServiceProcess) -> None:
    boxed.start()
    try:
        report = boxed.wait_ready(timeout=60)
    finally:
        code = boxed.stop(timeout=20)
    assert report["own"] == "mine"
    assert report["hidden"] == "Permission denied"  # the CA key's path is a device it may not open
    assert report["beside"] == "No such file or directory"  # not bound: does not exist for it
    assert report["pids"] == ["1"] and report["pid"] == 1  # its own PID namespace, first process
    # bubblewrap loaded the services' seccomp filter before the service: what it denies gets EPERM
    # (keyctl 250 and bpf 321 are x86-64 numbers), the resolver's UDP still works.
    if filter_missing() and os.environ.get(REQUIRE_ENV) != "1":
        pytest.skip(f"no seccomp filter for services here: {filter_missing()}")
    assert report["seccomp"] == ["2"], report
    if os.uname().machine == "x86_64":
        assert report["refused"] == dict.fromkeys(report["refused"], "Operation not permitted"), report
    assert report["udp socket"] == "allowed"
    assert boxed.pid is not None and boxed.pid != boxed.popen.pid  # type: ignore[union-attr]
    assert code == 7, f"SIGTERM went to bubblewrap, not the service: {code}"


def test_a_killed_boxed_service_reports_the_signal_and_is_restarted(boxed: ServiceProcess) -> None:
    boxed.start()
    boxed.wait_ready(timeout=60)
    events: list[dict[str, Any]] = []
    policy = RestartPolicy(base_delay_s=0.05, max_delay_s=0.2, max_restarts=3, window_s=60.0)
    supervisor = Supervisor([boxed], policy, on_event=events.append)
    supervisor.start()
    try:
        old = boxed.pid
        assert old is not None
        os.kill(old, signal.SIGKILL)
        wait_for(
            lambda: boxed.pid not in (None, old) and supervisor.status()["boxed"]["state"] == "running",
            30,
            "the killed service was restarted in a new box",
        )
        deaths = [e for e in events if e.get("event") == "died"]
        assert deaths and deaths[0]["last_exit"] == describe_exit(-signal.SIGKILL), json.dumps(events)
    finally:
        supervisor.stop()
        boxed.stop(timeout=20)


class StalledBox(ServiceBox):
    """A box whose launcher stops itself before it runs bubblewrap: no pid ever reaches the status pipe."""

    def argv(self, status_fd: int, seccomp_fd: int | None = None, userns_fd: int | None = None) -> list[str]:
        stalled = ["sh", "-c", 'kill -STOP $$; exec "$@"', "stalled"]
        return [*stalled, *super().argv(status_fd, seccomp_fd, userns_fd)]


def test_a_box_that_never_reports_fails_the_start_and_is_killed(
    boxed: ServiceProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading bubblewrap's status line has a deadline: a hung box is killed and named, never waited on."""
    monkeypatch.setattr(process, "BOX_START_S", 1.0)
    assert boxed.box is not None
    boxed.box = StalledBox(boxed.box.read_only, boxed.box.read_write, boxed.box.hidden, boxed.box.shown)
    with pytest.raises(ServiceStartError, match="boxed: bubblewrap did not report its box within 1 s"):
        boxed.start()
    assert boxed.popen is not None and boxed.popen.poll() is not None, "the stalled box was left running"
    with pytest.raises(ProcessLookupError):
        os.killpg(boxed.popen.pid, 0)  # nothing of its session is left


def test_the_renewer_copies_a_new_crl_into_every_service_directory_within_seconds(tmp_path: Path) -> None:
    """What reaches a boxed service's internal ports of `nebula pki revoke`: its own copy of the CRL."""
    pki = tmp_path / "pki"
    init_pki(pki, ["a", "b"])
    files = ensure_service_certificates(pki, "a")
    assert mirror_crl(pki, "a")  # a first copy for every service
    assert mirror_crl(pki, "a") == []  # nothing changed: nothing written
    renewer = LeafRenewer(pki, ["a"], interval_s=3600)
    renewer.start()
    try:
        codec = x509.load_pem_x509_certificate(files["codec"].cert.read_bytes())
        revoke_certificate(pki, "a", codec.serial_number)
        current = (pki / "a" / "crl.pem").read_bytes()
        copies = [tls.dir / "crl.pem" for tls in files.values()]
        wait_for(lambda: all(c.read_bytes() == current for c in copies), 10, "every service has the new CRL")
    finally:
        renewer.stop()
