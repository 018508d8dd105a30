"""The trainer's own box (``launcher/trainer_box.py``, ``userns.py``, ``box_entry.py``), for real.

A process started the way the launcher starts the trainer is a user of its own (not root) with no
capability, sees only what its box binds, and can still make a stage's box inside its own: the one
thing its box must allow that no other service's does.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nebula_common.durable import atomic_write
from nebula_common.launcher.service_box import ServiceBox, unavailable
from nebula_common.launcher.trainer_box import TrainerBox
from nebula_common.launcher.userns import TRAINER_UID, user_namespace

ROOT = os.geteuid() == 0
needs_box = pytest.mark.skipif(bool(unavailable()), reason=f"no bubblewrap box here: {unavailable()}")

PROBE = """
import json, os, subprocess, sys, time
from pathlib import Path
from services.trainer.sandbox import bwrap_command
work = Path(sys.argv[1])
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
processes = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
def readable(path):
    try:
        Path(path).read_bytes()
        return True
    except OSError:
        return False
stage = subprocess.run(
    bwrap_command(work, work, [], [sys.executable, "-c", "import os; print(os.getuid())"]),
    capture_output=True, text=True,
)
def others():
    return sorted(p for p in os.listdir("/proc") if p.isdigit() and p not in ("1", str(os.getpid())))
deadline = time.monotonic() + 10  # what the stage's box leaves ends at once and is reaped by PID 1
while others() and time.monotonic() < deadline:
    time.sleep(0.05)
print(json.dumps({
    "uid": os.getuid(),
    "caps": [status[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")],
    "no_new_privs": status["NoNewPrivs"].strip(),
    "own": readable(sys.argv[2]),
    "other": readable(sys.argv[3]),
    "processes": processes,
    "stage": stage.stdout.strip() or stage.stderr.strip(),
    "left": {p: open(f"/proc/{p}/stat").read().split()[2] for p in others()},
}))
"""


def _run_boxed(box: ServiceBox, argv: list[str]) -> dict[str, object]:
    namespace = user_namespace(box.user) if ROOT else None
    read, write = os.pipe()
    passed = tuple(fd for fd in (write, namespace) if fd is not None)
    try:
        done = subprocess.run(
            [*box.argv(write, None, namespace), *box.command(argv, namespace)],
            pass_fds=passed,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        for fd in (*passed, read):
            os.close(fd)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@needs_box
def test_a_boxed_trainer_is_its_own_user_reads_only_its_own_files_and_can_still_box_a_stage(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    data = tmp_path / "run" / "a" / "trainer"  # below root's 0700 tmp_path, as a real run directory is
    data.mkdir(parents=True)
    own = data / "own.key"
    own.write_text("the trainer's")
    own.chmod(0o600)
    other = tmp_path / "run" / "a" / "auth" / "signing.key"
    other.parent.mkdir(parents=True)
    other.write_text("auth's")
    box = TrainerBox(data, None)
    settings = box.prepare()
    request.addfinalizer(box.release)
    work = data / "stage-work"
    work.mkdir()
    if ROOT:
        os.chown(work, TRAINER_UID, TRAINER_UID)
    seen = _run_boxed(box.box(), [sys.executable, "-c", PROBE, str(work), str(own), str(other)])
    assert seen["own"] is True and seen["other"] is False, seen
    assert seen["caps"] == ["0000000000000000"] * 5 and seen["no_new_privs"] == "1", seen
    assert seen["processes"] == [1, 2], seen  # nothing of the host's: box_entry (PID 1) and the probe
    if ROOT:
        assert seen["uid"] == TRAINER_UID, seen
        assert os.stat(data).st_uid == TRAINER_UID and os.stat(own).st_uid == TRAINER_UID
    assert seen["stage"] == "40000", seen  # the stage's box, made from inside the trainer's (sandbox.py)
    assert seen["left"] == {}, seen["left"]  # box_entry (PID 1) reaped what the stage's box left
    if ROOT and not Path("/sys/fs/cgroup/cgroup.controllers").exists():
        assert settings == {"STAGE_CGROUP": box.cgroup_parent}


@needs_box
def test_without_box_entry_the_same_box_is_root_inside_a_check_that_can_fail(tmp_path: Path) -> None:
    """The entry is what makes the trainer another user: a plain box of a root launcher stays root."""
    if not ROOT:
        pytest.skip("the launcher is not root here: every box is the launcher's user")
    box = ServiceBox(read_write=(tmp_path / "data",))
    namespace = user_namespace(TRAINER_UID)
    read, write = os.pipe()
    try:
        done = subprocess.run(
            [*box.argv(write, None, namespace), sys.executable, "-c", "import os; print(os.getuid())"],
            pass_fds=(write, namespace),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        for fd in (write, read, namespace):
            os.close(fd)
    assert done.stdout.strip() == "0", done.stderr


@pytest.mark.skipif(not ROOT, reason="only root writes files as another user")
def test_a_key_renewed_into_the_trainers_folder_stays_readable_by_the_trainer(tmp_path: Path) -> None:
    folder = tmp_path / "identity"
    folder.mkdir()
    os.chown(folder, TRAINER_UID, TRAINER_UID)
    atomic_write(folder / "service.key", b"new key", mode=0o600)
    info = os.stat(folder / "service.key")
    assert (info.st_uid, info.st_gid, info.st_mode & 0o777) == (TRAINER_UID, TRAINER_UID, 0o600)
    atomic_write(tmp_path / "roots.key", b"root's", mode=0o600)  # a folder of root's: stays root's
    assert os.stat(tmp_path / "roots.key").st_uid == 0


@pytest.mark.skipif(not ROOT, reason="only root gives files away")
def test_prepare_gives_the_data_folder_to_the_trainer_but_not_the_signers(tmp_path: Path) -> None:
    data = tmp_path / "trainer"
    (data / "signer").mkdir(parents=True)
    (data / "accounts" / "alice").mkdir(parents=True)
    (data / "accounts" / "alice" / "model.pt").write_bytes(b"w")
    box = TrainerBox(data, None)
    box.prepare()
    try:
        assert os.stat(data / "accounts" / "alice" / "model.pt").st_uid == TRAINER_UID
        assert os.stat(data / "signer").st_uid == 0  # the signer (root, no capability) makes its socket there
        assert os.stat(data).st_mode & 0o777 == 0o700
    finally:
        box.release()  # its control-group folders, which outlive the test's tmp_path otherwise


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--setup", "/side", "true"], "usage: python -m nebula_common.launcher.box_entry"),
        (["--lifeline", "x", "--", "true"], "usage: python -m nebula_common.launcher.box_entry"),
        (["--lifeline", "987", "--", "true"], "the lifeline 987 is not an open file"),
    ],
)
def test_box_entry_refuses_a_bad_command_line_naming_what_is_wrong(argv: list[str], said: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "nebula_common.launcher.box_entry", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0 and said in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_trainer_user_id_that_belongs_to_someone_is_refused_naming_the_user() -> None:
    from nebula_common.errors import NebulaError
    from nebula_common.launcher.trainer_box import _check_unused

    with pytest.raises(NebulaError, match="belongs to user 'root'"):
        _check_unused(0)
    _check_unused(TRAINER_UID)  # nobody's here


@needs_box
@pytest.mark.skipif(not ROOT, reason="root reads every file whatever its mode")
def test_weights_the_trainers_user_may_not_read_are_named_as_unreadable_not_missing(tmp_path: Path) -> None:
    """safetensors calls an unreadable file missing; the trainer's validation says what is wrong."""
    import torch
    from safetensors.torch import save_file

    share = tmp_path / "share"
    share.mkdir()
    share.chmod(0o755)  # whatever the umask (a test before may have left a strict one)
    save_file({"w": torch.zeros(2)}, str(share / "model.safetensors"))  # 0600, root's: as HF saves
    probe = (
        "import json, sys; from pathlib import Path; from nebula_common.pretrained import weight_shapes, "
        "PretrainedError\ntry:\n    weight_shapes(Path(sys.argv[1]))\n    said = ''\n"
        "except PretrainedError as exc:\n    said = str(exc)\nprint(json.dumps({'said': said}))"
    )
    box = ServiceBox(read_only=(share,), nests=True)
    said = _run_boxed(box, [sys.executable, "-c", probe, str(share)])["said"]
    assert said == f"model.safetensors is not readable by this process's user (uid {TRAINER_UID})", said


SERVICE = """
import json, signal, sys, time
def stop(*_):
    print("drained", file=sys.stderr, flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # as a service does once it handles it
print(json.dumps({"ready": True}), flush=True)
time.sleep(120)
"""


@needs_box
def test_a_stop_reaches_a_boxed_trainer_through_its_entry(tmp_path: Path) -> None:
    """The launcher starts services with their stop signals blocked (``stop_signals.py``): the entry,
    the box's PID 1, must take them and pass them on, or a SIGTERM would never drain the trainer."""
    from nebula_common.launcher.process import ServiceProcess

    service = ServiceProcess(
        name="boxed-trainer",
        command=[sys.executable, "-c", SERVICE],
        env={},
        log_dir=tmp_path,
        holds_early_stop=True,
        box=ServiceBox(nests=True),
    )
    service.start()
    try:
        service.wait_ready(60)
        started = time.monotonic()
        assert service.stop(timeout=30) == 0, service.tail()
        assert time.monotonic() - started < 20, "the stop waited for the SIGKILL fallback"
        assert "drained" in service.tail(), service.tail()
    finally:
        service.kill()


LAUNCHER = """
import sys, time
from pathlib import Path
from nebula_common.launcher.process import ServiceProcess
from nebula_common.launcher.service_box import ServiceBox
marker, log_dir = sys.argv[1], Path(sys.argv[2])
# The trainer's place in the box: it starts a process of its own (a stage's) and both just run.
program = (
    "import json, subprocess, sys, time; "
    f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', {marker!r}]); "
    "print(json.dumps({'ready': True}), flush=True); time.sleep(600)"
)
service = ServiceProcess(
    name="boxed-trainer", command=[sys.executable, "-c", program, marker], env={}, log_dir=log_dir,
    box=ServiceBox(nests=True),
)
service.start()
service.wait_ready(60)
print("up", flush=True)
time.sleep(600)
"""


def _holding(marker: str) -> dict[int, list[bytes]]:
    """The processes of this machine whose command line names ``marker``: their command lines."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() in argv:
            found[int(entry)] = argv
    return found


@needs_box
def test_a_boxed_trainer_and_what_it_started_end_with_a_launcher_killed_outright(tmp_path: Path) -> None:
    """``kill -9`` of the launcher leaves nothing of a nesting box: its lifeline (``box_entry`` step 5)."""
    import signal
    import uuid

    marker = f"nebula-lifeline-{uuid.uuid4().hex}"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, marker, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert launcher.stdout is not None
        line = launcher.stdout.readline()  # "up" once the boxed service has said it is ready
        assert line.strip() == "up", f"the launcher did not start its box: {line!r} {launcher.stderr.read()}"
        running = _holding(marker).values()  # the launcher, bubblewrap, box_entry, the service, its child
        assert any(b"import time; time.sleep(600)" in argv for argv in running), running
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(30)
        deadline = time.monotonic() + 5  # issue 29: nothing of a job outlives it by more than 5 s
        while _holding(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = _holding(marker)
        assert not left, f"still running 5 s after the launcher was killed: {left}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        for pid in _holding(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
