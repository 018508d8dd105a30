"""A deployment's parts start together: what they start outlives their threads, and failures are reported.

Each service carries a parent-death signal (``with_parent``) that fires when the *thread* that started
it ends. A part started on a short-lived thread must not die with that thread: here a process started
from a thread that has ended still answers afterwards.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from nebula_common.launcher.process import ServiceProcess
from nebula_common.launcher.together import start_together

pytestmark = pytest.mark.timeout(120)

_ANSWER_WHEN_ASKED = """
import pathlib, sys, time
started, ask, answer = (pathlib.Path(arg) for arg in sys.argv[1:4])
started.write_text("running")
deadline = time.monotonic() + 60
while not ask.exists() and time.monotonic() < deadline:
    time.sleep(0.02)
answer.write_text("alive")
"""


def test_a_process_started_on_a_thread_that_ended_keeps_running(tmp_path: Path) -> None:
    started, ask, answer = tmp_path / "started", tmp_path / "ask", tmp_path / "answer"
    command = [sys.executable, "-c", _ANSWER_WHEN_ASKED, str(started), str(ask), str(answer)]
    process = ServiceProcess("answerer", command, {}, tmp_path)

    def start_and_wait_until_running() -> None:  # as a part waits for its service's ready line
        process.start()
        deadline = time.monotonic() + 60
        while not started.exists():  # its parent-death signal is set by now (before the program runs)
            assert time.monotonic() < deadline, "the process did not start within 60 s"
            time.sleep(0.02)

    starter = threading.Thread(target=start_and_wait_until_running, name="short-lived")
    starter.start()
    starter.join(90)
    assert not starter.is_alive() and started.exists(), "the process did not start"
    try:
        ask.write_text("are you there?")  # only now: the thread that asked for the start has ended
        deadline = time.monotonic() + 60
        while not answer.exists():
            code = process.poll()
            if code is not None:  # it may have answered and exited since the check above
                assert answer.exists(), f"the process died with its starting thread (exit {code})"
                break
            assert time.monotonic() < deadline, "no answer within 60 s"
            time.sleep(0.02)
        assert answer.read_text() == "alive"
    finally:
        process.stop(10)


def test_every_part_ends_before_the_first_failure_is_raised() -> None:
    finished: list[str] = []
    slow_may_end = threading.Event()

    def failing() -> None:
        slow_may_end.set()
        raise ValueError("codec did not start")

    def slow() -> None:
        assert slow_may_end.wait(30), "the failing part never ran"
        time.sleep(0.2)  # still running when the failure happened: the raise must wait for it
        finished.append("data")

    with pytest.raises(ValueError, match="codec did not start"):
        start_together([failing, slow])
    assert finished == ["data"]


def test_parts_run_at_the_same_time() -> None:
    both_running = threading.Barrier(2, timeout=30)
    start_together([both_running.wait, both_running.wait])  # one after the other would break the barrier
