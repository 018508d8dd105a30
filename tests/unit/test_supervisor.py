"""The local launcher's supervisor restarts dead processes, gives up on crash loops, never races a stop."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nebula_common.launcher.process import ServiceProcess
from nebula_common.launcher.supervisor import RestartPolicy, Supervisor, describe_exit

pytestmark = pytest.mark.timeout(90)

FAST = RestartPolicy(base_delay_s=0.05, max_delay_s=0.2, max_restarts=3, window_s=60.0)
SERVICE = "import json, time; print(json.dumps({'grpc_port': 1234}), flush=True); time.sleep(600)"
CRASHER = "import sys; print('boom', file=sys.stderr); sys.exit(3)"


def wait_for(condition: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting until {what}")


def process(tmp_path: Path, name: str, script: str) -> ServiceProcess:
    return ServiceProcess(name=name, command=[sys.executable, "-c", script], env={}, log_dir=tmp_path)


@pytest.fixture
def started(tmp_path: Path) -> Iterator[Callable[[str, str], ServiceProcess]]:
    made: list[ServiceProcess] = []

    def make(name: str, script: str = SERVICE) -> ServiceProcess:
        p = process(tmp_path, name, script)
        p.start()
        if script == SERVICE:
            p.wait_ready(timeout=30)
        made.append(p)
        return p

    yield make
    for p in made:
        p.stop(timeout=5)


def test_a_killed_process_is_restarted_and_the_others_are_untouched(
    tmp_path: Path, started: Callable[[str, str], ServiceProcess]
) -> None:
    victim, bystander = started("victim"), started("bystander")
    events: list[dict[str, Any]] = []
    supervisor = Supervisor(
        [victim, bystander], FAST, event_log=tmp_path / "supervisor.jsonl", on_event=events.append
    )
    supervisor.start()
    try:
        old, bystander_pid = victim.pid, bystander.pid
        os.kill(old, signal.SIGKILL)  # type: ignore[arg-type]
        # The supervisor marks the process running just before it emits "restarted": wait for both.
        wait_for(
            lambda: (
                victim.pid != old and supervisor.status()["victim"]["state"] == "running" and len(events) >= 2
            ),
            "restarted",
        )
        assert victim.popen.poll() is None  # type: ignore[union-attr]
        assert bystander.pid == bystander_pid and bystander.popen.poll() is None  # type: ignore[union-attr]
        status = supervisor.status()["victim"]
        assert status == {"state": "running", "restarts": 1, "last_exit": "signal SIGKILL"}
        assert supervisor.status()["bystander"]["restarts"] == 0
        assert [e["event"] for e in events] == ["died", "restarted"]
        logged = [json.loads(line) for line in (tmp_path / "supervisor.jsonl").read_text().splitlines()]
        assert logged[0]["service"] == "victim" and logged[0]["last_exit"] == "signal SIGKILL"
    finally:
        supervisor.stop()


def test_a_crash_loop_is_given_up_on_and_reported_while_the_rest_keeps_running(
    tmp_path: Path, started: Callable[[str, str], ServiceProcess]
) -> None:
    healthy = started("healthy")
    crasher = started("crasher", CRASHER)
    events: list[dict[str, Any]] = []
    supervisor = Supervisor([healthy, crasher], FAST, on_event=events.append)
    supervisor.start()
    try:
        # The state turns "failed" just before the event is delivered: wait for both.
        wait_for(
            lambda: (
                supervisor.status()["crasher"]["state"] == "failed"
                and any(e["event"] == "crash-loop" for e in events)
            ),
            "the crash loop was detected and reported",
        )
        status = supervisor.status()["crasher"]
        assert status["restarts"] == FAST.max_restarts and status["last_exit"] == "exit code 3"
        loop = [e for e in events if e["event"] == "crash-loop"]
        assert len(loop) == 1 and "not restarted again" in loop[0]["detail"]
        assert str(crasher.log_path) in loop[0]["detail"]
        assert healthy.popen.poll() is None and supervisor.status()["healthy"]["restarts"] == 0  # type: ignore[union-attr]
    finally:
        supervisor.stop()


def test_a_process_stopped_on_purpose_is_not_restarted(
    tmp_path: Path, started: Callable[[str, str], ServiceProcess]
) -> None:
    target = started("target")
    supervisor = Supervisor([target], FAST, interval_s=0.01)
    supervisor.start()
    try:
        assert target.stop(timeout=5) is not None
        deadline = time.monotonic() + 1.0  # many supervisor ticks (10 ms each) must pass
        while time.monotonic() < deadline:
            assert target.popen.poll() is not None, "a stopped process was restarted"  # type: ignore[union-attr]
            time.sleep(0.02)
        assert supervisor.status()["target"]["restarts"] == 0
        target.start()  # starting it again by hand puts it back under supervision
        target.wait_ready(timeout=30)
        old = target.pid
        os.kill(old, signal.SIGKILL)  # type: ignore[arg-type]
        wait_for(lambda: target.pid != old, "restarted after a manual start")
    finally:
        supervisor.stop()


def test_backoff_is_exponential_and_capped() -> None:
    policy = RestartPolicy(base_delay_s=0.5, max_delay_s=10.0)
    assert [policy.delay(n) for n in (1, 2, 3, 4, 5, 6, 10)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_exit_descriptions() -> None:
    assert describe_exit(-9) == "signal SIGKILL"
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(None) == "still running"
