"""The SDK's watch rides through a restart of the trainer: it re-opens, skips what it saw, ends once.

A real auth service, switch and trainer of cluster b in this process (``ServiceThread``), no cluster a:
the trainer's data dir holds the record of a stage (as a killed trainer leaves it), so the restored
stage opens its edge and stays RECOVERING while it waits for the WAN link that never comes. The
trainer is stopped under a live watch (its stage is cancelled on the way down, and its record keeps
that end) and started again on the same port; the watch re-opens, sees the CANCELLED end once,
and ends. A trainer that stays away ends the watch after its reconnect budget with an error that
says so; an unknown job fails at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from nebula_common.clients.endpoints import ClusterEndpoints
from nebula_common.errors import NebulaError
from nebula_common.pki import PkiLayout
from nebula_common.ports import service_port
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.auth_client import AuthClient
from nebula_common.sdk.client import ClusterSession
from services.trainer.config import TrainerSettings
from services.trainer.records import StageRecords
from services.trainer.server import SERVICE as TRAINER_SERVICE
from services.trainer.servicer import TrainerServicer
from tests.support.accounts import ADMIN_PASSWORD, auth_settings
from tests.support.jobs import numbers_job
from tests.support.servers import AuthServerThread, SwitchThread, accepting_switch, running_auth
from tests.support.service_thread import ServiceThread

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
def auth(tmp_path: Path) -> Iterator[AuthServerThread]:
    with running_auth(auth_settings(tmp_path, "b")) as server:
        yield server


@pytest.fixture
def switch(tmp_path: Path, pki_ab: PkiLayout, auth: AuthServerThread) -> Iterator[SwitchThread]:
    with accepting_switch(tmp_path, pki_ab.cluster("b"), "a", auth.address) as running:
        yield running


def start_trainer(
    auth: AuthServerThread, switch: SwitchThread, data_dir: Path, port: int
) -> ServiceThread[TrainerServicer]:
    settings = TrainerSettings(
        cluster_id="b",
        listen=f"127.0.0.1:{port}",
        switch_address=switch.internal_address,
        auth_address=auth.address,
        data_dir=data_dir,
        metrics_port=-1,
        stop_grace_s=5.0,
        # The trainer sets torch's (process-wide) thread count: keep this test process's own.
        torch_threads=torch.get_num_threads(),
    )
    return ServiceThread(TRAINER_SERVICE, settings, timeout=30)


def wait_for(
    condition: Callable[[], bool], what: str, detail: Callable[[], str], timeout: float = 30.0
) -> None:
    """Poll ``condition``; on timeout fail with ``detail()``: what the watch saw, so a failure says why."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting until {what}; {detail()}")


def listeners(port: int) -> list[str]:
    """The local addresses of every listening TCP socket on ``port`` (the kernel's table): more than one
    means something else shares the trainer's port."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state = fields[1], fields[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                found.append(f"{local} inode {fields[9]}")
    return found


@pytest.mark.faults  # restarts a trainer under a watch (`make test-faults`)
def test_a_watch_rides_through_a_trainer_restart_and_ends_once(
    tmp_path: Path, auth: AuthServerThread, switch: SwitchThread
) -> None:
    with AuthClient(auth.address) as client:
        admin = client.login("admin", ADMIN_PASSWORD).token
        client.create_account(admin, "alice", "alice-password-1")
        token = client.login("alice", "alice-password-1").token
    data_dir = tmp_path / "trainer"
    spec = numbers_job("job-w", steps=5).stage_spec("decoder")
    StageRecords(data_dir).create(spec, token, "alice")  # as a trainer killed mid-stage leaves it
    port = service_port()
    trainer = start_trainer(auth, switch, data_dir, port)
    endpoints = ClusterEndpoints(
        cluster_id="b", auth=auth.address, trainer=f"127.0.0.1:{port}", switch="127.0.0.1:1"
    )
    session = ClusterSession(endpoints, token, "alice", watch_reconnect_s=60.0)
    seen: list[trainer_pb2.StageStatus] = []
    errors: list[BaseException] = []

    def watch() -> None:
        try:
            seen.extend(session.watch("job-w"))
        except BaseException as exc:
            errors.append(exc)

    def observed() -> str:
        states = [f"{trainer_pb2.StageState.Name(s.state)}@{s.epoch}: {s.message}" for s in seen]
        return (
            f"the watch saw {states}, errors {errors!r}; trainer at 127.0.0.1:{port}, "
            f"listening sockets on that port: {listeners(port)}"
        )

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    wait_for(
        lambda: any(s.state == trainer_pb2.STAGE_STATE_RECOVERING for s in seen),
        "the stage is RECOVERING",
        observed,
    )
    recovering = next(s for s in seen if s.state == trainer_pb2.STAGE_STATE_RECOVERING)
    assert recovering.epoch == 1 and "trainer restarted" in recovering.message

    trainer.stop()  # the watch loses its stream; the stage is drained, left to resume, not ended
    assert watcher.is_alive() and not errors, errors
    trainer = start_trainer(auth, switch, data_dir, port)
    try:
        wait_for(
            lambda: any(s.state == trainer_pb2.STAGE_STATE_RECOVERING and s.epoch == 2 for s in seen),
            "the stage is resumed at epoch 2 by the restarted trainer",
            observed,
        )
        session.cancel("job-w")  # only a cancel ends it
        watcher.join(30)
        assert not watcher.is_alive() and not errors, (errors, seen)
        finals = [s for s in seen if s.state in (trainer_pb2.STAGE_STATE_CANCELLED,)]
        assert len(finals) == 1 and seen[-1] is finals[0], [
            trainer_pb2.StageState.Name(s.state) for s in seen
        ]
        keys = [s.SerializeToString(deterministic=True) for s in seen]
        assert len(keys) == len(set(keys)), "a status was yielded twice"
        with pytest.raises(NebulaError, match="no job 'nope'"):
            list(session.watch("nope"))  # NOT_FOUND on the first call: at once, not retried
    finally:
        trainer.stop()

    started = time.monotonic()
    with pytest.raises(NebulaError, match=r"trainer unreachable for 2 s \(last: UNAVAILABLE"):
        list(session.watch("job-w", reconnect_s=2.0))
    assert 2.0 <= time.monotonic() - started < 10.0
    session.close()
