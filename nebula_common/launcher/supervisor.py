"""Restart a local deployment's service processes when they die, like a container runtime would.

A process that exits while it is wanted (any exit code, a signal, ``kill -9``) is restarted with
the same command and environment. The launcher pins every port a service reported at its first
start into that environment, so a restarted service comes back on the same ports and its peers
reconnect to the address they already know. Restarts wait a capped exponential backoff
(``base * 2**(n-1)``, at most ``cap``; ``n`` counts deaths since the service last ran ``stable_s``
seconds). A service that dies more than ``max_restarts`` times within ``window_s`` is crash-looping:
the supervisor gives up on that one service, says so (log, event, ``state: "failed"`` in the
status), and keeps every other service running, because a cluster without, say, its codec still
serves jobs that do not need it; ``nebula local up`` keeps running and reports it.

One thread polls every process a few times a second; restarts never block each other (a
restarted process is "starting" until it prints its ready line, which is checked without waiting).
``ServiceProcess.stop()`` marks a process unwanted under the same lock the supervisor checks, so an
intentional stop is never mistaken for a crash; ``Supervisor.stop()`` ends the thread before the
deployment stops its processes, so no restart races a shutdown.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nebula_common.launcher.process import ServiceProcess, ServiceStartError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    """When and how often a dead service is restarted."""

    base_delay_s: float = 0.5
    max_delay_s: float = 10.0
    max_restarts: int = 5  # more deaths than this within window_s: crash-looping, give up
    window_s: float = 60.0
    stable_s: float = 30.0  # running this long resets the backoff
    start_timeout_s: float = 90.0  # a restart that does not report ready in time counts as a death

    def delay(self, consecutive: int) -> float:
        return min(self.max_delay_s, self.base_delay_s * 2 ** max(0, consecutive - 1))


def describe_exit(returncode: int | None) -> str:
    """``exit code 3`` or ``signal SIGKILL`` (Popen reports a signal as a negative code)."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


@dataclass
class _Watch:
    process: ServiceProcess
    state: str = "running"  # running | backoff | starting | failed
    restarts: int = 0
    consecutive: int = 0
    deaths: deque[float] = field(default_factory=deque)
    since: float = field(default_factory=time.monotonic)
    retry_at: float = 0.0
    last_exit: str | None = None
    expected_ports: dict[str, Any] = field(default_factory=dict)


class Supervisor:
    """Watches ``processes`` on a background thread and restarts the ones that die (see module doc)."""

    def __init__(
        self,
        processes: Sequence[ServiceProcess],
        policy: RestartPolicy | None = None,
        *,
        event_log: Path | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        interval_s: float = 0.2,
    ) -> None:
        self.policy = policy or RestartPolicy()
        self._watches = {p.name: _Watch(p, expected_ports=_ports(p.info)) for p in processes}
        self._event_log = event_log
        self._on_event = on_event
        self._interval = interval_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.generation = 0  # bumped on every event, so a caller knows when to rewrite its status

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="nebula-supervisor", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop watching (and restarting); the processes themselves are left as they are."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def status(self) -> dict[str, dict[str, Any]]:
        """Per process: state, restart count, last exit (for deployment.json)."""
        with self._lock:
            return {
                name: {"state": w.state, "restarts": w.restarts, "last_exit": w.last_exit}
                for name, w in self._watches.items()
            }

    def restarts(self, name: str) -> int:
        with self._lock:
            return self._watches[name].restarts

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            for watch in list(self._watches.values()):
                if self._stop.is_set():
                    return
                try:
                    self._tick(watch)
                except Exception:  # a bug here must not end the supervision of every other service
                    logger.exception("supervisor failed to handle %s", watch.process.name)

    def _tick(self, watch: _Watch) -> None:
        process = watch.process
        now = time.monotonic()
        with process.lock:
            if not process.wanted or self._stop.is_set():
                return  # stopped on purpose (or a shutdown is under way): never restarted
            if watch.state == "failed":
                return
            if watch.state == "backoff":
                if now >= watch.retry_at:
                    try:
                        process.start()
                    except (OSError, ServiceStartError) as exc:  # no processes, a hung box: a crash
                        self._died(watch, f"cannot start: {exc}", now)
                        return
                    with self._lock:
                        watch.state, watch.since = "starting", now
                return
            code = process.poll() if process.popen is not None else -1
        if code is None:
            if watch.state == "starting":
                self._check_started(watch, now)
            elif watch.consecutive and now - watch.since >= self.policy.stable_s:
                with self._lock:
                    watch.consecutive = 0
            return
        self._died(watch, describe_exit(code), now)

    def _check_started(self, watch: _Watch, now: float) -> None:
        process = watch.process
        try:
            info = process.poll_ready()
        except ValueError:
            info = None
        if info is None:
            if now - watch.since > self.policy.start_timeout_s:
                process.kill()
                process.popen.wait(5)  # type: ignore[union-attr]
                self._died(watch, f"no ready line within {self.policy.start_timeout_s:.0f}s", now)
            return
        ports = _ports(info)
        with self._lock:
            watch.state, watch.since = "running", now
        if watch.expected_ports and ports != watch.expected_ports:
            self._emit(
                "restart-ports-changed",
                watch,
                level=logging.ERROR,
                detail=f"came back on {ports}, expected {watch.expected_ports}; its peers cannot reach it",
            )
        self._emit("restarted", watch, detail=f"pid {process.pid}")

    def _died(self, watch: _Watch, how: str, now: float) -> None:
        with self._lock:
            watch.last_exit = how
            watch.deaths.append(now)
            while watch.deaths and now - watch.deaths[0] > self.policy.window_s:
                watch.deaths.popleft()
            if len(watch.deaths) > self.policy.max_restarts:
                watch.state = "failed"
            else:
                watch.restarts += 1
                watch.consecutive += 1
                watch.state = "backoff"
                watch.retry_at = now + self.policy.delay(watch.consecutive)
        if watch.state == "failed":
            self._emit(
                "crash-loop",
                watch,
                level=logging.ERROR,
                detail=(
                    f"died {len(watch.deaths)} times within {self.policy.window_s:.0f}s (last: {how}); "
                    f"not restarted again, the other services keep running; see {watch.process.log_path}"
                ),
            )
        else:
            self._emit(
                "died",
                watch,
                level=logging.WARNING,
                detail=f"{how}; restart {watch.restarts} in {watch.retry_at - now:.1f}s",
            )

    def _emit(self, event: str, watch: _Watch, *, detail: str, level: int = logging.INFO) -> None:
        record = {
            "time": time.time(),
            "event": event,
            "service": watch.process.name,
            "restarts": watch.restarts,
            "last_exit": watch.last_exit,
            "detail": detail,
        }
        with self._lock:
            self.generation += 1
        logger.log(
            level, "supervisor: %s %s (restarts %d): %s", watch.process.name, event, watch.restarts, detail
        )
        if self._event_log is not None:
            try:
                with self._event_log.open("a", encoding="utf-8") as out:
                    out.write(json.dumps(record) + "\n")
            except OSError as exc:
                logger.warning("cannot append to %s: %s", self._event_log, exc)
        if self._on_event is not None:
            try:
                self._on_event(record)
            except Exception:
                logger.exception("supervisor event listener failed")


def _ports(info: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in info.items() if key.endswith("_port")}
