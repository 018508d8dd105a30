"""A service the launcher starts in a session of its own keeps the launcher's priority (autogroups)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

AUTOGROUP = Path("/proc/self/autogroup")

SCRIPT = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from nebula_common.launcher.process import ServiceProcess

    print(os.nice(7))  # 7 more than the test runner's (itself nice 10 on a shared host: 17)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    process = ServiceProcess("sleeper", sleeper, {}, Path(sys.argv[1]))
    process.start()
    try:
        print(os.getsid(process.pid) == process.pid)
        print(Path(f"/proc/{process.pid}/autogroup").read_text().strip())
        print(os.getpriority(os.PRIO_PROCESS, process.pid))
    finally:
        process.stop(10)
    """
)


@pytest.mark.skipif(not AUTOGROUP.exists(), reason="kernel without autogroup scheduling")
def test_a_service_started_under_nice_gets_that_nice_for_its_new_session(tmp_path: Path) -> None:
    # A child interpreter takes the nice, so this test process keeps its own priority.
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    launcher_nice, own_session, autogroup, nice = done.stdout.splitlines()[:4]
    assert int(launcher_nice) >= 7
    assert own_session == "True"  # start_new_session: a session, hence an autogroup, of its own
    assert nice == launcher_nice
    # Without keep_priority the new session's group competed at nice 0 whatever the process's nice.
    assert autogroup.endswith(f" nice {launcher_nice}"), autogroup
