"""One service process: started with its env, ports read from its first stdout line, stopped gracefully."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nebula_common import seccomp
from nebula_common.errors import NebulaError
from nebula_common.launcher.service_box import ServiceBox, filter_missing
from nebula_common.launcher.userns import user_namespace
from nebula_common.rpc.internal_tls import internal_channel
from nebula_common.stop_signals import stop_signals_blocked


class ServiceStartError(NebulaError):
    pass


def with_parent(command: list[str]) -> list[str]:
    """``command`` ending with the launcher, however the launcher ends (``kill -9`` included).

    A boxed service has bubblewrap's ``--die-with-parent`` (a nesting box, its lifeline); an unboxed
    one (the WAN emulator, every service where bubblewrap is missing) would run on orphaned. util-linux's
    ``setpriv --pdeathsig`` gives it the same parent-death signal, then executes it (its pid stays the
    service's). As bubblewrap's, the signal comes when the launcher's *thread* that started it ends:
    every service is started by the launcher's spawner thread (``_spawner``), which lives as long as the
    launcher. Where ``setpriv`` is missing (it is in util-linux, which every Debian has), the command
    runs as is."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *command] if setpriv else command


_SPAWNER: ThreadPoolExecutor | None = None
_SPAWNER_LOCK = threading.Lock()


def _spawner() -> ThreadPoolExecutor:
    """The one thread that starts every service process of this launcher, living as long as it does.

    A service's parent-death signal (``with_parent``, bubblewrap's ``--die-with-parent``) comes when the
    *thread* that started it ends: a deployment's parts start together on short-lived threads
    (``together.py``), whose ends must not kill what they started. The signal mask that holds an early
    stop is the spawner's too, set around each start (``stop_signals_blocked``).
    """
    global _SPAWNER
    with _SPAWNER_LOCK:
        if _SPAWNER is None:
            _SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spawner")
        return _SPAWNER


BOX_START_S = 30.0
"""How long bubblewrap may take to create a box (it reports the service's pid in milliseconds); a box
that never reports (a hung mount, say) is killed and the start fails, naming it, instead of hanging."""


@dataclass
class ServiceProcess:
    name: str
    command: list[str]
    env: dict[str, str]
    log_dir: Path
    popen: subprocess.Popen[bytes] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    # False once stop() was asked for: a supervisor must not restart a process stopped on purpose.
    # ``lock`` makes "is it dead, and was that wanted?" one question (see Supervisor).
    wanted: bool = False
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)
    # For a process that prints no JSON ports line (the WAN emulator): True once it is ready.
    ready_probe: Callable[[], bool] | None = field(default=None, repr=False, compare=False)
    # A Nebula service (its entry point is ``run_service_main``, which unblocks them): started with
    # SIGINT and SIGTERM blocked, so a stop in its first milliseconds waits for its handler.
    holds_early_stop: bool = False
    # Started inside a bubblewrap box of its own (``service_box.py``): ``pid`` is then the service's
    # own process (the box's first), which is what is signalled; ``popen`` is bubblewrap's.
    box: ServiceBox | None = field(default=None, repr=False, compare=False)
    boxed_pid: int | None = field(default=None, repr=False, compare=False)
    # A nesting box's lifeline (``box_entry`` step 5): the write end, held only here (not inherited by
    # anything this process starts) and closed once the box has ended, or with this process.
    lifeline: int | None = field(default=None, repr=False, compare=False)

    @property
    def pid(self) -> int | None:
        if self.box is not None:
            return self.boxed_pid
        return self.popen.pid if self.popen is not None else None

    def poll(self) -> int | None:
        """The exit status as Popen reports it (a signal negative), for a boxed service too.

        bubblewrap exits with 128 + the signal's number when its service was killed by one.
        """
        if self.popen is None:
            return None
        code = self.popen.poll()
        if code is not None and self.box is not None and 128 < code < 128 + 65:
            return -(code - 128)
        return code

    @property
    def stdout_path(self) -> Path:
        return self.log_dir / f"{self.name}.out"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def start(self) -> None:
        """Start the process from the launcher's spawner thread (``_spawner``), whichever thread asks.

        The asking thread holds ``lock`` meanwhile (a supervisor asks holding it already). An interrupt
        (Ctrl-C) while it waits lets the start finish first, so a ``stop()`` after it finds the process.
        """
        with self.lock:
            spawned = _spawner().submit(self._spawn)
            try:
                spawned.result()
            except BaseException:
                with contextlib.suppress(BaseException):
                    spawned.result()
                raise

    def _spawn(self) -> None:
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        held = stop_signals_blocked() if self.holds_early_stop else contextlib.nullcontext()
        with (
            open(self.stdout_path, "wb") as out,
            open(self.log_path, "ab") as err,
            held,  # a stop before its handler exists waits for it (stop_signals.py)
        ):
            if self.box is None:
                self.popen = subprocess.Popen(
                    with_parent(self.command),
                    env=env,
                    stdout=out,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            else:
                self._start_boxed(self.box, env, out, err)
            keep_priority(self.popen.pid)  # type: ignore[union-attr]
            self.wanted = True

    def _start_boxed(self, box: ServiceBox, env: dict[str, str], out: Any, err: Any) -> None:
        """Start inside the box; learn the service's own pid from bubblewrap's status line."""
        read, write = os.pipe()
        program = None if box.nests or filter_missing() else seccomp.program_fd(seccomp.SERVICE)
        # Run as root, the launcher makes the box's user namespace (``userns.py``): the trainer's user in it.
        namespace = user_namespace(box.user) if os.geteuid() == 0 else None
        self._cut_lifeline()
        held = None
        if box.nests:
            held, self.lifeline = os.pipe()
        passed = tuple(fd for fd in (write, program, namespace, held) if fd is not None)
        try:
            self.boxed_pid = None
            self.popen = subprocess.Popen(
                [*box.argv(write, program, namespace), *box.command(self.command, namespace, held)],
                env=env,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=passed,
            )
        except BaseException:
            os.close(read)
            self._cut_lifeline()
            raise
        finally:
            for fd in passed:
                os.close(fd)
        if not _readable_within(read, BOX_START_S):
            os.close(read)
            self._kill_group()
            raise ServiceStartError(
                f"{self.name}: bubblewrap did not report its box within {BOX_START_S:.0f} s (killed); "
                f"last log lines:\n{self.tail()}"
            )
        status = os.fdopen(read, "rb")
        line = status.readline()  # the child's pid, written once its namespaces exist; b"" if it failed
        with contextlib.suppress(ValueError, KeyError, json.JSONDecodeError):
            self.boxed_pid = int(json.loads(line)["child-pid"])
        # bubblewrap writes its exit code there at the end: read until then, or it dies of SIGPIPE.
        threading.Thread(target=_drain, args=(status,), name=f"box-{self.name}", daemon=True).start()

    def _kill_group(self) -> None:
        """SIGKILL bubblewrap's whole session (it was started in a new one) and reap it."""
        assert self.popen is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)
        self._cut_lifeline()

    def _cut_lifeline(self) -> None:
        """Close the lifeline's write end: a box still running behind it ends (``box_entry`` step 5)."""
        if self.lifeline is not None:
            os.close(self.lifeline)
            self.lifeline = None

    def poll_ready(self) -> dict[str, Any] | None:
        """The ports line if the process has written it (non-blocking), else None."""
        if self.ready_probe is not None:
            return self.info if self.ready_probe() else None
        text = self.stdout_path.read_text() if self.stdout_path.exists() else ""
        if not text.endswith("\n"):
            return None
        self.info = json.loads(text.splitlines()[0])
        return self.info

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        """Wait for the JSON line announcing the ports; fail fast if the process dies."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen is not None and self.poll() is not None:
                raise ServiceStartError(
                    f"{self.name} exited with code {self.poll()} during start-up; "
                    f"last log lines:\n{self.tail()}"
                )
            info = self.poll_ready()
            if info is not None:
                return info
            time.sleep(0.05)
        raise ServiceStartError(f"{self.name} did not report its ports within {timeout:.0f}s:\n{self.tail()}")

    def tail(self, lines: int = 15) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM for a graceful drain, SIGKILL if it does not exit in time (never restarted)."""
        with self.lock:
            self.wanted = False
            if self.popen is None or self.popen.poll() is not None:
                self._cut_lifeline()
                return None if self.popen is None else self.poll()
            self.signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.popen.wait(5)
        self._cut_lifeline()
        return self.poll()

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the service itself (inside its box, not to bubblewrap)."""
        if self.popen is None or self.popen.poll() is not None:
            return
        if self.box is None or self.boxed_pid is None:
            self.popen.send_signal(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.boxed_pid, signum)

    def kill(self) -> None:
        """SIGKILL the service; bubblewrap, whose child it is, then exits with it."""
        self.signal(signal.SIGKILL)
        if self.popen is not None and self.box is not None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.kill()  # --die-with-parent: the box's process goes with it
        self._cut_lifeline()  # and a nesting box's PID 1 (another user's) with its lifeline


def _readable_within(fd: int, timeout: float) -> bool:
    """Whether ``fd`` has data (or its end of file) within ``timeout`` seconds."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    return bool(poller.poll(timeout * 1000))


def _drain(status: Any) -> None:
    with status:
        while status.readline():
            pass


def keep_priority(pid: int) -> None:
    """Give a child started in a session of its own the launcher's priority (its nice).

    With the kernel's autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``) every session
    competes for the CPU as one group at nice 0, whatever its processes' own nice: under
    ``start_new_session`` a ``nice -n 10`` launch would not lower the services against the rest of the
    machine, nor a ``nice -n -15`` benchmark raise them (measured: a pinned trainer at -15 waited on the
    run queue 6x as long as it ran, next to nice-10 work of other sessions). The child's autogroup gets
    the launcher's nice; a negative one needs CAP_SYS_NICE. Without autogroups, or the right to, the
    child keeps what the kernel gave it.
    """
    nice = os.nice(0)
    if nice != 0:
        with contextlib.suppress(OSError):
            Path(f"/proc/{pid}/autogroup").write_text(f"{nice}\n")


_ROLE_OF_HEALTH_NAME = {
    "nebula.v1.Auth": "auth",
    "nebula.v1.Codec": "codec",
    "nebula.v1.Data": "data",
    "nebula.v1.Relay": "switch",
    "nebula.v1.Trainer": "trainer",
}


def wait_healthy(address: str, service: str = "", timeout: float = 30.0) -> None:
    """Block until ``address`` answers grpc.health.v1 SERVING for ``service``.

    The channel is the internal one (TLS pinned to the service's role, see ``internal_tls``).
    """
    deadline = time.monotonic() + timeout
    last = "no answer"
    role = _ROLE_OF_HEALTH_NAME.get(service, "switch")
    with internal_channel(address, service=role) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as exc:
                last = exc.code().name
            time.sleep(0.1)
    raise ServiceStartError(f"{address} ({service or 'server'}) not healthy within {timeout:.0f}s: {last}")


def console_command(module: str, *args: str) -> list[str]:
    """Run a service module with this interpreter, so the launcher works from any venv."""
    return [sys.executable, "-m", module, *args]
