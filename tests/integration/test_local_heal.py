"""Crashes heal under the local launcher: kill -9 a service and it comes back on the same ports.

Also: the WAN emulator's fault controls on a running deployment, and a second start on the same run
directory keeping the admin password and accounts. No job runs while the trainer or switch is killed
(jobs surviving that is the data-plane rewrite's business).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from nebula_common.cli.app import app
from nebula_common.launcher import LocalDeployment
from nebula_common.launcher.process import wait_healthy
from nebula_common.sdk.auth_client import AuthClient
from nebula_common.sdk.client import ClusterSession
from tests.support.accounts import create_account, make_user

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.timeout(240)]

HEAL_DEADLINE_S = 60.0  # a restart takes ~1 s idle; generous for a machine shared by four engineers
HEALTH_SERVICE = {
    "auth": "nebula.v1.Auth",
    "codec": "nebula.v1.Codec",
    "data": "nebula.v1.Data",
    "switch": "nebula.v1.Relay",
    "trainer": "nebula.v1.Trainer",
}


def wait_for(condition: Callable[[], Any], what: str, timeout: float = HEAL_DEADLINE_S) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            value = condition()
        except Exception as exc:  # the service may still be coming back
            last, value = exc, None
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting until {what} (last error: {last!r})")


@pytest.fixture(scope="module")
def heal(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    run_dir: Path = tmp_path_factory.mktemp("nebula-heal")
    with LocalDeployment(run_dir=run_dir, bandwidth_mbit=100.0, delay_ms=5.0) as running:
        yield running


def pids(deployment: LocalDeployment) -> dict[str, int | None]:
    return {p.name: p.pid for p in deployment.all_processes()}


def kill_and_wait_restart(deployment: LocalDeployment, name: str) -> None:
    """kill -9 ``name``; wait until the supervisor reports it running again and it answers health."""
    process = deployment.process(name)
    restarts = deployment.supervisor.restarts(name)  # type: ignore[union-attr]
    ports = {k: v for k, v in process.info.items() if k.endswith("_port")}
    old = process.pid
    others = {n: pid for n, pid in pids(deployment).items() if n != name}
    os.kill(old, signal.SIGKILL)  # type: ignore[arg-type]
    wait_for(
        lambda: process.pid != old and deployment.supervisor.status()[name]["state"] == "running",  # type: ignore[union-attr]
        f"{name} was restarted",
    )
    status = deployment.supervisor.status()[name]  # type: ignore[union-attr]
    assert status["restarts"] == restarts + 1 and status["last_exit"] == "signal SIGKILL", status
    assert {k: v for k, v in process.info.items() if k.endswith("_port")} == ports  # same ports
    kind = name.split("-")[0]
    port = process.info["internal_port" if kind == "switch" else "grpc_port"]
    wait_healthy(f"127.0.0.1:{port}", HEALTH_SERVICE[kind], timeout=HEAL_DEADLINE_S)
    assert {n: pid for n, pid in pids(deployment).items() if n != name} == others  # nobody else moved
    assert all(p.popen.poll() is None for p in deployment.all_processes())  # type: ignore[union-attr]


def admin_login(deployment: LocalDeployment, cluster: str, password: str | None = None) -> str:
    with AuthClient(deployment.endpoints(cluster).auth) as auth:
        return auth.login("admin", password or deployment.cluster_state[cluster].admin_password).token


def wait_link(session: ClusterSession, up: bool, timeout: float = HEAL_DEADLINE_S) -> None:
    wait_for(lambda: session.link_status().connected == up, f"the link is {'up' if up else 'down'}", timeout)


def test_killed_auth_is_restarted_and_login_works_again(heal: LocalDeployment) -> None:
    password = create_account(heal, "a", "carol")  # an account made before the crash
    kill_and_wait_restart(heal, "auth-a")
    assert wait_for(lambda: admin_login(heal, "a"), "the admin can log in again")
    ClusterSession.login(heal.endpoints("a"), "carol", password)  # accounts survive (SQLite on disk)


def test_killed_codec_is_restarted(heal: LocalDeployment) -> None:
    kill_and_wait_restart(heal, "codec-b")


def test_killed_idle_switch_and_trainer_are_restarted_and_the_link_returns(heal: LocalDeployment) -> None:
    a = make_user(heal, "a", "dave")
    wait_link(a, up=True)
    kill_and_wait_restart(heal, "switch-b")  # the acceptor: the dialer finds it again through the WAN
    wait_link(a, up=True)
    kill_and_wait_restart(heal, "trainer-a")
    kill_and_wait_restart(heal, "switch-a")  # the dialer
    b = make_user(heal, "b", "erin")
    wait_link(b, up=True)
    assert b.link_status().connected


def test_wan_fault_controls_on_the_running_deployment(heal: LocalDeployment) -> None:
    a = make_user(heal, "a", "frank")
    wait_link(a, up=True)
    heal.write_description(heal.run_dir / "deployment.json")
    result = CliRunner().invoke(app, ["wan", "status", "--run-dir", str(heal.run_dir)])
    assert result.exit_code == 0 and '"cut": false' in result.output, result.output

    # Cut first, then reset: reset alone lets the dialer redial at once (its backoff starts at 0.2 s).
    result = CliRunner().invoke(app, ["wan", "cut", "--run-dir", str(heal.run_dir)])
    assert result.exit_code == 0 and '"cut": true' in result.output, result.output
    assert heal.wan.reset_connections() >= 1  # the switches' link, RST like a lost NAT entry
    wait_link(a, up=False)
    # While cut, the dialer's new connection is accepted but never reaches the peer: the link stays
    # down for a whole observation window (several redial attempts).
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        assert not a.link_status().connected, "the link came up through a cut WAN"
        time.sleep(0.2)
    heal.wan.restore()
    wait_link(a, up=True)
    status = heal.wan.status()
    assert status["cut"] is False and status["cuts_total"] >= 1 and status["resets_total"] >= 1


def test_killed_wan_emulator_is_restarted_on_its_port(heal: LocalDeployment) -> None:
    a = make_user(heal, "a", "gina")
    emulator = heal.process("wan-emulator")
    old = emulator.pid
    os.kill(old, signal.SIGKILL)  # type: ignore[arg-type]
    wait_for(
        lambda: emulator.pid != old and heal.supervisor.status()["wan-emulator"]["state"] == "running",  # type: ignore[union-attr]
        "the WAN emulator was restarted",
    )
    wait_for(lambda: heal.wan.status(), "its control port answers")
    wait_link(a, up=True)


def test_a_second_start_on_the_same_run_dir_keeps_the_admin_password_and_accounts(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with LocalDeployment(run_dir=run_dir, bandwidth_mbit=100.0, delay_ms=5.0) as first:
        passwords = {c: first.cluster_state[c].admin_password for c in ("a", "b")}
        user_password = create_account(first, "b", "henry")
    secrets_before = {
        p: p.read_bytes() for p in [run_dir / "a" / "admin-password", run_dir / "b" / "admin-password"]
    }
    with LocalDeployment(run_dir=run_dir, bandwidth_mbit=100.0, delay_ms=5.0) as second:
        for cluster, password in passwords.items():
            assert second.cluster_state[cluster].admin_password == password
            assert admin_login(second, cluster, password)  # the old password still logs in
        ClusterSession.login(second.endpoints("b"), "henry", user_password)
    assert {p: p.read_bytes() for p in secrets_before} == secrets_before


def test_a_restarted_service_stops_as_gracefully_as_the_others(tmp_path: Path) -> None:
    """A service the supervisor restarted has the supervisor's thread as its parent: the deployment's
    stop must end that thread after the services, or its parent-death signal kills them first."""
    with LocalDeployment(run_dir=tmp_path / "run", bandwidth_mbit=100.0, delay_ms=5.0) as deployment:
        kill_and_wait_restart(deployment, "codec-a")
        restarted, untouched = deployment.process("codec-a"), deployment.process("codec-b")
    assert restarted.popen is not None and untouched.popen is not None
    assert (restarted.popen.returncode, untouched.popen.returncode) == (0, 0)
