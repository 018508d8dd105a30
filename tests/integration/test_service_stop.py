"""SIGTERM at any moment of a service's life ends its process with exit 0, within its grace period.

Each of the six services (the audit signer included) is started as its own process
(``python -m services.<name>``) and signalled at four moments, each detected, never guessed with a sleep:

* ``exec``: at once, as the launcher starts it (SIGINT and SIGTERM blocked across the exec,
  ``nebula_common/stop_signals.py``): before Python has even started, let alone installed a handler;
* ``importing``: as soon as the kernel shows the process catching SIGTERM (``SigCgt`` in
  ``/proc/<pid>/status``), i.e. while torch and gRPC are still loading;
* ``starting``: after its "starting" log line, while it acquires resources (the services that
  need auth are pointed at one that never answers, so they are caught waiting for it);
* ``serving``: after its ready line; for codec that is while its start-up calibration runs in
  torch on a background thread, the race that used to abort it.

``NEBULA_STOP_REPEAT`` repeats every case (default 1; ``make test-stop`` runs 5).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from nebula_common.pki import init_pki
from nebula_common.stop_signals import stop_signals_blocked
from services.auth.config import AuthSettings
from services.auth.server import SERVICE as AUTH_SERVICE
from tests.support.service_thread import ServiceThread

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.timeout(900)]

REPO_ROOT = Path(__file__).resolve().parents[2]
REPEAT = int(os.environ.get("NEBULA_STOP_REPEAT", "1"))
GRACE_S = 15.0
"""Longest any service may take from SIGTERM to exit (the k8s manifests allow 15 s)."""
SERVICES = ("auth", "codec", "data", "switch", "trainer", "signer")
MOMENTS = ("exec", "importing", "starting", "serving")


@dataclass(frozen=True)
class Cluster:
    work: Path
    auth_address: str
    silent_address: str
    """A listening socket that never speaks gRPC: services waiting for auth there stay in start-up."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("stop")
    init_pki(work / "pki", ["a", "b"])
    auth = ServiceThread(
        AUTH_SERVICE,
        AuthSettings(
            cluster_id="a",
            data_dir=work / "shared-auth",
            metrics_port=-1,
            argon2_time_cost=1,
            argon2_memory_cost_kib=1024,
        ),
    )
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    try:
        yield Cluster(work, auth.address, f"127.0.0.1:{silent.getsockname()[1]}")
    finally:
        silent.close()
        auth.stop()


def _env(service: str, cluster: Cluster, run: Path, auth_address: str) -> dict[str, str]:
    a = cluster.work / "pki" / "a"
    settings: dict[str, str] = {
        "CLUSTER_ID": "a",
        "METRICS_PORT": "0",
        "LOG_LEVEL": "INFO",
    }
    if service == "auth":
        (run / "password").write_text("stop-test-admin-password")
        settings |= {
            "DATA_DIR": str(run / "auth"),
            "ADMIN_PASSWORD_FILE": str(run / "password"),
            "ARGON2_TIME_COST": "1",
            "ARGON2_MEMORY_COST_KIB": "1024",
        }
    elif service == "codec":
        settings |= {"AUTH_ADDRESS": auth_address, "CALIBRATION_CACHE": "off"}
    elif service == "data":
        settings |= {"AUTH_ADDRESS": auth_address, "DATA_DIR": str(run / "data")}
    elif service == "signer":
        settings |= {
            "DATA_DIR": str(run / "signer"),
            "SOCKETS": f"auth={run / 'auth' / 'signer' / 'signer.sock'}",
        }
    elif service == "trainer":
        settings |= {
            "AUTH_ADDRESS": auth_address,
            "SWITCH_ADDRESS": "127.0.0.1:9",
            "DATA_DIR": str(run / "trainer"),
        }
    else:
        settings |= {
            "PEER_CLUSTER_ID": "b",
            "LINK_ROLE": "accept",
            "AUTH_ADDRESS": auth_address,
            "TLS_CERT": str(a / "switch.crt"),
            "TLS_KEY": str(a / "switch.key"),
            "TRUST_BUNDLE": str(a / "trust-bundle.pem"),
            "DATA_DIR": str(run / "switch"),
        }
    prefix = f"NEBULA_{service.upper()}_"
    return {**os.environ, **{prefix + key: value for key, value in settings.items()}}


def _catches_sigterm(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask, 16) & (1 << (signal.SIGTERM - 1)))


def _wait_for(condition: object, what: str, process: subprocess.Popen[str], timeout: float = 60.0) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            pytest.fail(f"process exited ({process.returncode}) before {what}: {process.stderr.read()}")  # type: ignore[union-attr]
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout:.0f} s")
        time.sleep(0.005)


def _wait_for_line(stream: object, match: str, process: subprocess.Popen[str], timeout: float = 90.0) -> str:
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)  # type: ignore[arg-type]
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"no line containing {match!r} within {timeout:.0f} s")
            if selector.select(timeout=remaining):
                line = stream.readline()  # type: ignore[attr-defined]
                if not line:
                    pytest.fail(f"process exited ({process.wait()}) before printing {match!r}")
                if match in line:
                    return line


@pytest.mark.parametrize("moment", MOMENTS)
@pytest.mark.parametrize("service", SERVICES)
def test_sigterm_at_any_moment_exits_zero(
    cluster: Cluster, service: str, moment: str, tmp_path: Path
) -> None:
    for attempt in range(REPEAT):
        run = tmp_path / f"run-{attempt}"
        run.mkdir()
        # Waiting in start-up means waiting for an auth service that never answers.
        auth_address = cluster.silent_address if moment == "starting" else cluster.auth_address
        with stop_signals_blocked():  # as the launcher starts services (launcher/process.py)
            process = subprocess.Popen(
                [sys.executable, "-m", f"services.{service}"],
                cwd=REPO_ROOT,
                env=_env(service, cluster, run, auth_address),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        try:
            if moment == "exec":
                pass  # the signal goes out right after the fork, before the interpreter runs
            elif moment == "importing":
                pid = process.pid
                _wait_for(lambda pid=pid: _catches_sigterm(pid), "SIGTERM handler", process)
            elif moment == "starting":
                _wait_for_line(process.stderr, '"message": "starting"', process)
            else:
                ready = json.loads(_wait_for_line(process.stdout, '"service"', process))
                assert ready["service"] == service and ready["cluster_id"] == "a"
            process.send_signal(signal.SIGTERM)
            try:
                code = process.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{service} still running {GRACE_S:.0f} s after SIGTERM while {moment}")
            stderr = process.stderr.read()  # type: ignore[union-attr]
            assert code == 0, (
                f"{service} exited {code} on SIGTERM while {moment} (attempt {attempt}):\n{stderr}"
            )
            assert "terminate called" not in stderr and "Traceback" not in stderr, stderr
            if moment == "serving":  # the process ends without Python's teardown: its last line is flushed
                assert '"message": "stopped"' in stderr, stderr
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            for stream in (process.stdout, process.stderr):
                if stream is not None:
                    stream.close()
