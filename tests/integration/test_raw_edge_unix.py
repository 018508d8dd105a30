"""The Unix socket edge (``raw_edge_unix``, services/switch/raw_edge.py) under `nebula local up`.

Real processes, real internal TLS, real Unix sockets:

* a job's edges run on each switch's Unix socket (both switches audit ``edge.open`` with
  ``transport: unix``) and the job succeeds;
* the socket is 0600 in a 0700 directory; with those loosened, a child process running as ``nobody``
  that holds a valid ticket is refused for its uid before the ticket is read (``auth.refused``,
  ``transport: unix``), and the ticket then still opens the edge once for this uid, never twice.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from nebula_common.launcher import LocalDeployment
from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.sdk.client import ClusterSession, submit_job
from nebula_common.sdk.summary import summarize
from tests.integration.test_raw_edge import (
    SPEC,
    STEPS,
    _audited,
    _fields,
    _refused_code,
    _ticket,
    _trainer_tls,
    switch_audit,
)
from tests.support.accounts import make_user
from tests.support.jobs import numbers_job

pytestmark = [pytest.mark.integration, pytest.mark.rawedge, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def unix_deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    run_dir: Path = tmp_path_factory.mktemp("nebula-unix-edge")
    # The sockets live outside pytest's 0700 tree, so that a test can open the way to them for another
    # user (only under /tmp's own sticky 1777, in a 0700 directory of this test's).
    base = Path(tempfile.mkdtemp(prefix="nebula-unix-edge-"))
    sockets = base / "sockets-{cluster}" / "edge.sock"
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("NEBULA_SWITCH_EDGE_TRANSPORT", "raw")
            env.setenv("NEBULA_TRAINER_EDGE_TRANSPORT", "raw")
            env.setenv("NEBULA_SWITCH_RAW_EDGE_UNIX", str(sockets))
            env.setenv("NEBULA_TRAINER_RAW_EDGE_UNIX", str(sockets))
            with LocalDeployment(run_dir=run_dir, bandwidth_mbit=100.0, delay_ms=5.0) as running:
                running.edge_sockets = base  # type: ignore[attr-defined]
                yield running
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _socket_path(deployment: LocalDeployment, cluster: str) -> Path:
    return Path(deployment.edge_sockets) / f"sockets-{cluster}" / "edge.sock"  # type: ignore[attr-defined]


def _unix_exchange(path: Path, record: bytes) -> bytes:
    """Connect to the Unix socket edge as this process, send one record, read one."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(path))
        # A switch refusing this peer's uid may answer and close before the record is sent.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(len(record).to_bytes(4, "big") + record)
        head = b""
        while len(head) < 4:
            part = sock.recv(4 - len(head))
            if not part:
                return b""
            head += part
        size = int.from_bytes(head, "big")
        body = b""
        while len(body) < size:
            part = sock.recv(size - len(body))
            if not part:
                break
            body += part
        return body


def _exchange_as(user: pwd.struct_passwd, path: Path, record: bytes) -> bytes:
    """``_unix_exchange`` from a forked child that dropped to ``user`` first (real credentials)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only system calls from here, then _exit
        code = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            answer = _unix_exchange(path, record)
            os.write(write_end, answer if answer else b"-")
            code = 0
        except BaseException as exc:  # reported through the pipe: the parent's assertion shows it
            os.write(write_end, f"child failed: {exc!r}".encode())
        finally:
            os._exit(code)
    os.close(write_end)
    chunks = []
    with os.fdopen(read_end, "rb") as pipe:
        while chunk := pipe.read(65536):
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    body = b"".join(chunks)
    assert os.waitstatus_to_exitcode(status) == 0, body
    return body


def test_a_job_runs_on_unix_socket_edges(unix_deployment: LocalDeployment) -> None:
    sessions: dict[str, ClusterSession] = {
        "a": make_user(unix_deployment, "a", "alice"),
        "b": make_user(unix_deployment, "b", "bob"),
    }
    job = numbers_job(**SPEC)
    summary = summarize(job, submit_job(job, sessions))
    assert summary.succeeded, summary.stage_messages
    assert len(summary.losses) == STEPS
    for cluster in ("a", "b"):
        opens = [_fields(r) for r in switch_audit(unix_deployment, cluster, "edge.open")]
        on_unix = [r for r in opens if r.get("job_id") == job.job_id and r.get("transport") == "unix"]
        assert on_unix, f"switch {cluster} audited no Unix socket edge of the job: {opens}"


@pytest.mark.skipif(os.getuid() != 0, reason="running a child as another user needs root")
def test_a_peer_of_another_uid_is_refused_and_audited(unix_deployment: LocalDeployment) -> None:
    path = _socket_path(unix_deployment, "a")
    assert stat.S_ISSOCK(path.lstat().st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    session = make_user(unix_deployment, "a", "carol")
    ready = _ticket(unix_deployment, _trainer_tls(unix_deployment), session.metadata, "unix-uid")

    # Loosen the file system's guard so that another user reaches the socket: the uid check must hold.
    base = path.parent.parent
    base.chmod(0o711)
    path.parent.chmod(0o711)
    path.chmod(0o666)
    try:
        nobody = pwd.getpwnam("nobody")
        answer = _exchange_as(nobody, path, ready.raw_edge_ticket)
    finally:
        path.chmod(0o600)
        path.parent.chmod(0o700)
        base.chmod(0o700)
    assert _refused_code(answer) == "PERMISSION_DENIED"
    _audited(
        unix_deployment,
        "auth.refused",
        lambda r: r.get("transport") == "unix" and f"uid {nobody.pw_uid}" in str(r.get("reason")),
        "the other uid's audit record",
    )

    # The refused peer never got to present the ticket: its holder (this uid) opens the edge, once.
    answer = _unix_exchange(path, ready.raw_edge_ticket)
    message = relay_pb2.EdgeMessage.FromString(answer)
    assert message.WhichOneof("body") == "ready", message
    assert _refused_code(_unix_exchange(path, ready.raw_edge_ticket)) == "UNAUTHENTICATED"
    _audited(
        unix_deployment,
        "edge.open",
        lambda r: r.get("transport") == "unix" and "already used" in str(r.get("reason")),
        "the reused ticket's audit record",
    )
