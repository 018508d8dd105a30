"""A local deployment whose start fails part-way leaves no process behind and its run directory free.

When one service fails to start, the services already started (and any still importing) must all be
stopped, and nothing started after the failure.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from nebula_common.launcher import LocalDeployment
from nebula_common.launcher.process import ServiceStartError
from nebula_common.launcher.run_dir import running_deployment_pid

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def processes_using(run_dir: Path) -> list[int]:
    """Pids of live processes whose environment names ``run_dir`` (every service of that deployment)."""
    needle = str(run_dir).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone meanwhile, or not ours
            continue
        if needle in environ and state != "Z":
            found.append(int(entry.name))
    return found


def test_a_service_failing_at_start_leaves_no_process_and_the_run_dir_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not Path("/proc/self/environ").exists():
        pytest.skip("needs /proc to find the deployment's processes")
    run_dir = tmp_path / "run"
    # Inherited by the codec services only: they refuse to start, while data, the switches and the
    # emulator start beside them.
    monkeypatch.setenv("NEBULA_CODEC_MAX_TENSOR_BYTES", "not-a-number")
    deployment = LocalDeployment(run_dir=run_dir, bandwidth_mbit=100.0, delay_ms=5.0)
    with pytest.raises(ServiceStartError, match=r"(?s)codec-[ab] exited .*MAX_TENSOR_BYTES"):
        deployment.start()
    deadline = time.monotonic() + 30
    while (left := processes_using(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes of the failed deployment still running: {left}"
    for cluster in ("a", "b"):  # a cluster whose turn never came has no state at all
        state = deployment.cluster_state.get(cluster)
        assert state is None or state.trainer is None, f"trainer-{cluster} was started after the failure"
    # The run directory is not held any more: a second start may use it.
    assert running_deployment_pid(run_dir) is None
