"""`nebula local up` keeps two clusters running until interrupted, then stops every process it started."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import Result
from typer.testing import CliRunner

from tests.support.deployments import alive, assert_gone

# Two deployments start here, one after the other: on a busy 2-CPU machine each may take minutes.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
# 12 services start one after another: 110 s at load 30, over 180 s at load 32 (the old deadline);
# this test's start and stop together took 316 s at load 30-33.
START_DEADLINE_S = 420.0
# After Ctrl-C they stop kind by kind: 43 s at load 32 (55 s one by one, over the old 60 s).
STOP_DEADLINE_S = 120.0


@pytest.mark.faults  # kills a service and restarts the deployment (`make test-faults`)
def test_local_up_runs_until_interrupted_and_leaves_nothing_behind(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    up = subprocess.Popen(
        [sys.executable, "-m", "nebula_common.cli.app", "local", "up", "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        description = run_dir / "deployment.json"
        deadline = time.monotonic() + START_DEADLINE_S
        while not description.exists() and time.monotonic() < deadline and up.poll() is None:
            time.sleep(0.2)
        assert description.exists(), f"no deployment.json within {START_DEADLINE_S:.0f} s"
        deployment = json.loads(description.read_text())
        pids = [p["pid"] for c in deployment["clusters"].values() for p in c["processes"].values()]
        # signer, auth, codec, data, switch and trainer in each cluster
        assert len(pids) == 12 and all(alive(pid) for pid in pids)
        assert (run_dir / "pki" / "a" / "switch.crt").exists()
        assert oct((run_dir / "a" / "admin-password").stat().st_mode & 0o777) == "0o600"

        time.sleep(1.0)  # still up: it does not exit on its own
        assert up.poll() is None
        up.send_signal(signal.SIGINT)
        output, _ = up.communicate(timeout=STOP_DEADLINE_S)
    except Exception as failure:
        output = reap(up, run_dir)
        raise AssertionError(f"{failure}\n--- nebula local up said:\n{output}") from failure
    except BaseException:
        reap(up, run_dir)
        raise
    assert up.returncode == 0, output
    assert "cluster a: auth :" in output and "WAN emulator: 60 Mbit/s" in output, output
    assert '"clusters"' not in output, "the whole description is printed only with --json"
    assert_gone(pids)


@pytest.mark.faults  # a deployment of its own (`make test-faults`)
def test_local_up_killed_outright_takes_every_process_it_started_with_it(tmp_path: Path) -> None:
    """``kill -9`` of `nebula local up`: no handler runs, yet no service and no WAN emulator is left
    running (boxed services by bubblewrap's parent-death signal, the unboxed emulator by setpriv's)."""
    run_dir = tmp_path / "run"
    up, deployment = start_up(run_dir)
    try:
        pids = all_pids(deployment)
        assert len(pids) == 13 and all(alive(pid) for pid in pids.values()), pids
        up.kill()
        up.communicate(timeout=30)
        deadline = time.monotonic() + 5  # issue 29: nothing outlives what started it by more than 5 s
        while any(alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = {name: pid for name, pid in pids.items() if alive(pid)}
        assert not left, f"still running 5 s after `nebula local up` was killed: {left}"
    finally:
        reap(up, run_dir)


def reap(up: subprocess.Popen[str], run_dir: Path) -> str:
    """Stop a `local up` that a failed test leaves behind, with every service it started.

    The services run in their own sessions, so killing `up` alone would orphan them: ask `up` to
    shut down first (SIGINT, as a user would), then kill whatever still names the run directory.
    """
    output = ""
    if up.poll() is None:
        up.send_signal(signal.SIGINT)
    try:
        output = up.communicate(timeout=STOP_DEADLINE_S)[0] or ""
    except subprocess.TimeoutExpired:
        up.kill()
        output = up.communicate(timeout=30)[0] or ""
    marker = str(run_dir).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if marker in (entry / "cmdline").read_bytes() or marker in (entry / "environ").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
    return output


def start_up(
    run_dir: Path, previous_pids: frozenset[int] = frozenset()
) -> tuple[subprocess.Popen[str], dict]:
    """Start `nebula local up` on ``run_dir``; wait for a deployment.json naming none of ``previous_pids``."""
    up = subprocess.Popen(
        [sys.executable, "-m", "nebula_common.cli.app", "local", "up", "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    description = run_dir / "deployment.json"

    def current() -> dict | None:
        try:
            data = json.loads(description.read_text())
        except (OSError, ValueError):
            return None
        if previous_pids & set(all_pids(data).values()):
            return None  # still the previous deployment's description
        return data

    deadline = time.monotonic() + START_DEADLINE_S
    while (data := current()) is None and time.monotonic() < deadline and up.poll() is None:
        time.sleep(0.2)
    if data is None:
        raise AssertionError(f"no deployment.json within {START_DEADLINE_S:.0f} s:\n{reap(up, run_dir)}")
    return up, data


def all_pids(description: dict) -> dict[str, int]:
    pids = {n: p["pid"] for c in description["clusters"].values() for n, p in c["processes"].items()}
    return pids | {"wan-emulator": description["wan_emulator"]["pid"]}


def stop_up(up: subprocess.Popen[str], pids: list[int]) -> str:
    up.send_signal(signal.SIGINT)
    output, _ = up.communicate(timeout=STOP_DEADLINE_S)
    assert up.returncode == 0, output
    assert_gone(pids)
    return output


def login(description: dict, cluster: str, username: str, password: str) -> str:
    from nebula_common.sdk.auth_client import AuthClient
    from nebula_common.sdk.deployment import trust_described_cluster

    trust_described_cluster(cluster, description["clusters"][cluster])  # verify its ports' TLS
    port = description["clusters"][cluster]["processes"][f"auth-{cluster}"]["grpc_port"]
    with AuthClient(f"127.0.0.1:{port}") as auth:
        return auth.login(username, password).token


def admin_login(description: dict, cluster: str, password: str) -> str:
    return login(description, cluster, "admin", password)


def secret_files(run_dir: Path) -> dict[str, str]:
    """sha256 of every secret in a run directory: private keys, passwords, tokens, account credentials."""
    found = {}
    for path in sorted(run_dir.rglob("*")):
        name = path.name
        secret = name.endswith((".key", "key.pem")) or name in {"admin-password", "wan-control-token"}
        if path.is_file() and (secret or path.parent.name == "credentials"):
            found[str(path.relative_to(run_dir))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def cli(*args: str) -> Result:
    """The `nebula` CLI in this process (no second torch import)."""
    from nebula_common.cli.app import app

    return CliRunner().invoke(app, list(args))


@pytest.mark.faults  # a kill and two deployments: `make test-faults`
@pytest.mark.timeout(900)  # two starts and stops: 390 s at load 20-27, 682 s at load 30-33
def test_local_up_restarts_a_killed_service_and_a_second_up_keeps_every_secret(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    up, first = start_up(run_dir)
    try:
        before = all_pids(first)
        os.kill(before["codec-a"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        entry: dict = {}
        while time.monotonic() < deadline and up.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                entry = json.loads((run_dir / "deployment.json").read_text())["clusters"]["a"]["processes"]
                entry = entry["codec-a"]
                if entry.get("restarts") == 1 and entry.get("state") == "running":
                    break
            time.sleep(0.2)
        assert up.poll() is None, "nebula local up exited after one service died"
        assert entry.get("restarts") == 1 and entry["last_exit"] == "signal SIGKILL", entry
        assert entry["pid"] != before["codec-a"] and alive(entry["pid"])
        assert entry["grpc_port"] == first["clusters"]["a"]["processes"]["codec-a"]["grpc_port"]
        assert all(alive(pid) for name, pid in before.items() if name != "codec-a")
        after = all_pids(json.loads((run_dir / "deployment.json").read_text()))
        status = cli("local", "status", "--run-dir", str(run_dir), "--json")
        assert status.exit_code == 0, status.output
        assert json.loads(status.stdout)["command"] == "nebula local up"
        services = json.loads(status.stdout)["services"]
        assert len(services) == 12 and all(s["alive"] for s in services.values()), services
        # How each trainer confines its stages is never silent: named in the status, bubblewrap or why not.
        for trainer in ("trainer-a", "trainer-b"):
            isolation = services[trainer]["stage_isolation"]
            named = isolation.startswith(("bwrap:", "landlock (ABI")) or "process: the trainer" in isolation
            assert named, isolation
            edges = services[trainer]["stage_edges"]  # and how its stages' edges travel
            assert edges.startswith("records on the switch's edge socket "), edges
            assert edges.endswith("switch.sock"), edges
        # So is what keeps each service from the others' keys: their boxes, or that there are none.
        boxes = json.loads(status.stdout)["service_isolation"]
        assert boxes.startswith(
            ("bwrap: the audit signer, auth, codec, data, the switch and the trainer", "none (")
        ), boxes
        created = cli("account", "create", "keeper", "--run-dir", str(run_dir), "--json")
        assert created.exit_code == 0, created.output
        keeper = json.loads(created.stdout)["accounts"]
    except BaseException:
        reap(up, run_dir)
        raise
    output = stop_up(up, list(after.values()))
    assert "codec-a died" in output and "codec-a restarted" in output, output

    stopped = cli("local", "status", "--run-dir", str(run_dir))
    assert stopped.exit_code == 3 and "no deployment is running" in stopped.stdout, stopped.output
    secrets_before = secret_files(run_dir)
    assert {"a/admin-password", "b/admin-password", "credentials/keeper.yaml", "pki/a/ca.key"} <= set(
        secrets_before
    ), sorted(secrets_before)
    password_file = run_dir / "a" / "admin-password"
    password = password_file.read_text()
    up, second = start_up(run_dir, previous_pids=frozenset(after.values()))
    try:
        assert secret_files(run_dir) == secrets_before  # nothing overwritten, nothing lost
        assert admin_login(second, "a", password)  # the old password still logs in
        for cluster in ("a", "b"):  # and so do the accounts created before the restart
            assert login(second, cluster, "keeper", keeper[cluster]["password"])
    except BaseException:
        stop_up(up, list(all_pids(second).values()))
        raise
    down = subprocess.run(
        [sys.executable, "-m", "nebula_common.cli.app", "local", "down", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert down.returncode == 0 and "stopped `nebula local up` in" in down.stdout, down.stdout + down.stderr
    output, _ = up.communicate(timeout=30)
    assert up.returncode == 0, output
    assert not [pid for pid in all_pids(second).values() if alive(pid)]
