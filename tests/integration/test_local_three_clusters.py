"""`nebula local up --clusters 3`: clusters a, b and c, every switch linked to both others.

Started as an operator starts it (the CLI, in its own process); `nebula local status` lists the 15
services of three clusters alive; each switch's metrics show a link up to each of its two peers
(``nebula_switch_peer_link_up{peer=...}``), through a WAN emulator in front of each accepting
switch; `nebula local down` stops everything.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nebula_common.metrics import read_metrics
from nebula_common.sdk.deployment import DeploymentTarget
from tests.support.deployments import assert_gone, wait_description

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]
# 17 processes, one after another: 4.2 min on 2 CPUs at load 20, over 6 min at load 30-37.
START_DEADLINE_S = 600.0
CLUSTERS = ("a", "b", "c")
E2E_ENV = "NEBULA_THREE_CLUSTERS_E2E"


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nebula_common.cli.app", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _links_up(url: str) -> dict[str, float]:
    text = read_metrics(url)
    pattern = r'^nebula_switch_peer_link_up\{peer="([a-z]+)"\} ([0-9.]+)$'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.MULTILINE)}


@pytest.mark.skipif(
    not os.environ.get(E2E_ENV),
    reason=f"17 processes, 4 min on busy cores: `make test-three-clusters` (sets {E2E_ENV}=1)",
)
def test_local_up_three_clusters_links_every_pair_and_status_shows_them(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    started = time.monotonic()
    up = subprocess.Popen(
        [
            sys.executable,
            *("-m", "nebula_common.cli.app", "local", "up", "--clusters", "3", "--run-dir", str(run_dir)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deployment = wait_description(up, run_dir, START_DEADLINE_S)  # else fails with up's output
        assert sorted(deployment["clusters"]) == list(CLUSTERS)
        assert sorted(deployment["wan_emulators"]) == ["b", "c"]  # a dials b and c, b dials c

        status = _cli("local", "status", "--run-dir", str(run_dir), "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        assert json.loads(status.stdout)["clusters"] == list(CLUSTERS)
        services = json.loads(status.stdout)["services"]
        assert sorted({s["cluster"] for s in services.values()}) == list(CLUSTERS)
        assert len(services) == 18 and all(s["alive"] for s in services.values()), services
        text = _cli("local", "status", "--run-dir", str(run_dir))
        assert "clusters: a, b, c" in text.stdout, text.stdout
        assert all(f"switch-{c}" in text.stdout for c in CLUSTERS), text.stdout

        # The CLI's view of the description registers the monitoring identity for each /metrics.
        target = DeploymentTarget.load(run_dir)
        switches = {c: target.clusters[c][0].metrics[f"switch-{c}"] for c in CLUSTERS}
        expected = {c: {p: 1.0 for p in CLUSTERS if p != c} for c in CLUSTERS}
        links: dict[str, dict[str, float]] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            links = {c: _links_up(switches[c]) for c in CLUSTERS}
            if links == expected:
                break
            time.sleep(0.2)
        assert links == expected, f"links up per switch: {links}"
        print(f"3 clusters up, every pair linked, {time.monotonic() - started:.1f}s after `local up`")

        pids = [s["pid"] for s in services.values()]
        pids += [e["pid"] for e in deployment["wan_emulators"].values()]
        # 17 processes stop one after another: allow for a busy machine (local down waits 90 s by default).
        stopping = time.monotonic()
        down = _cli("local", "down", "--run-dir", str(run_dir), "--timeout", "400", timeout=450)
        assert down.returncode == 0, down.stdout + down.stderr
        print(f"`local down` stopped the 17 processes in {time.monotonic() - stopping:.1f}s")
        up.communicate(timeout=120)
        assert_gone(pids, "`local down`")
    finally:
        if up.poll() is None:  # a failed check: stop it as Ctrl-C would, so no service is left behind
            up.send_signal(signal.SIGINT)
            try:
                up.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                up.kill()
                up.communicate(timeout=30)
