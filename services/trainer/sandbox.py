"""Where a stage process runs: the confinement the trainer puts every stage in, and how it is probed.

Three modes, the strongest available chosen at start-up (``NEBULA_TRAINER_STAGE_ISOLATION``):

* ``bwrap`` (Debian's bubblewrap): the stage gets its own user, PID, IPC, UTS, cgroup and network
  namespaces (no network at all: its one way out is the trainer's Unix socket, ``stage_proxy``), a
  fresh ``/proc`` that shows only its own processes, a new session, and a filesystem view of only the
  interpreter, the installed packages, Nebula's own code, its account's directory of the trainer's
  data dir (read-write) and the pre-trained directories its spec declares (read-only). Nothing else of
  the host exists for it: no PKI, no run directory, no other account's checkpoints, no records.
  ``--die-with-parent``: a trainer that dies takes its stages with it (and resumes them on restart).
* ``landlock`` (where bubblewrap cannot create namespaces, as in a container): a separate process
  that restricts itself with Landlock before the job's code is loaded (``landlock``): it reads only
  its code and declared folders, writes only its account's directory and private ones, has no TCP and
  may neither signal nor ptrace anything outside its box; it keeps the trainer's user.
* ``process``: a separate process with an empty environment, its own session and the limits below,
  but the trainer's user and view of the host: it can read whatever the trainer's user can. Only
  where neither of the above works; the trainer logs a warning at start-up naming why, and reports
  the mode (``nebula local status``).

In all of them, the stage's own entry point (``stage_main``) sets its limits (memory, CPU seconds, open
files), refuses ptrace and core dumps of itself (``PR_SET_DUMPABLE`` 0) and new privileges
(``PR_SET_NO_NEW_PRIVS``), and loads a seccomp filter of the system calls no stage may make
(``seccomp_filter``; probed at start-up, and named when missing) before any of the job's code is
loaded.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nebula_common.bwrap import SYSTEM_ETC, code_roots, system_binds
from nebula_common.ports import ephemeral_range
from services.trainer import cgroup, landlock, seccomp_filter

log = logging.getLogger(__name__)

MODES = ("auto", "bwrap", "landlock", "process")
STAGE_UID = 40000
"""The stage's user and group id inside its namespace (not a user of the host)."""
INSIDE_SOCKET_DIR = "/run/nebula-stage"
"""Where the stage finds its trainer's socket (bound from a private directory of the host)."""
PROBE_TIMEOUT_S = 60.0
NETWORK_ETC = ("/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/etc/host.conf", "/etc/gai.conf")
"""What a box that keeps TCP reads of /etc besides: how its host's name and its peers' resolve (gloo
binds to the address its host name resolves to, and falls back to loopback, unreachable from other
hosts, when it cannot)."""
NETWORK_SYS = ("/sys/class/net", "/sys/bus/pci/devices", "/sys/devices")
"""And of /sys, read-only: the interfaces and devices gloo and NCCL look their network devices up in."""
NETWORK_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES", "LOCAL_RANK")
"""What of its service's environment a box with TCP gets: how ranks reach each other, which device."""


class SandboxError(RuntimeError):
    """The requested confinement cannot be had on this host (message names the setting and why)."""


@dataclass(frozen=True)
class StageLimits:
    """Per stage process: what ``stage_main`` sets on itself before loading the job's code."""

    memory_bytes: int
    cpu_seconds: int
    open_files: int
    processes: int = 512
    """Processes and threads of the stage together (its control group's ``pids.max``)."""

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Confinement:
    """The mode this trainer runs stages in, and why not a stronger one (empty when it is the strongest)."""

    mode: str
    weaker_because: str = ""
    cgroups_missing: str = ""
    """Why stages get no control group here ("" when they do: ``cgroup.StageGroup``)."""
    landlock_abi: int = 0
    """The kernel's Landlock ABI (``landlock`` mode)."""
    seccomp_missing: str = ""
    """Why stages get no system-call filter here ("" when they do: ``seccomp_filter``)."""
    cgroup_parent: str = cgroup.PARENT
    """The control-group folder stage groups are made in (``NEBULA_TRAINER_STAGE_CGROUP``)."""
    network: bool = False
    """Whether the box keeps TCP (a rank's box, whose ranks meet over it: ``rank_box``)."""

    def describe(self) -> str:
        groups = (
            "a control group each"
            if not self.cgroups_missing
            else f"no control group ({self.cgroups_missing})"
        )
        groups += (
            f"; seccomp allows {len(seccomp_filter.allowed())} system calls (systemd's @system-service "
            f"less {len(seccomp_filter.DENIED)})"
            if not self.seccomp_missing
            else f"; no seccomp filter ({self.seccomp_missing})"
        )
        if self.mode == "bwrap":
            net = "network namespaces"
            if self.network:
                net = "the host's network (TCP " + (
                    "to its host's ephemeral ports only, by Landlock)"
                    if self.landlock_abi >= landlock.TCP_ABI
                    else f"to any port: Landlock ABI {self.landlock_abi} cannot limit it)"
                )
            return f"bwrap: own user, PID and {net}, sees its code and account only; {groups}"
        if self.mode == "landlock":
            gaps = [gap for gap in landlock.gaps(self.landlock_abi) if not (self.network and "TCP" in gap)]
            left = f"; not covered: {', '.join(gaps)}" if gaps else ""
            tcp = "TCP to its host's ephemeral ports only" if self.network else "no TCP"
            return (
                f"landlock (ABI {self.landlock_abi}): reads its code and account only, {tcp}, no signal "
                f"or ptrace outside its box; the trainer's user, no namespaces ({self.weaker_because})"
                f"{left}; {groups}"
            )
        return f"process: the trainer's user, no namespaces ({self.weaker_because}); {groups}"


def _code_roots() -> list[Path]:
    """What a stage needs to import: the interpreter's prefix, the environment's and Nebula's packages."""
    import nebula_common
    import services

    return code_roots((nebula_common, services))


def bwrap_command(
    work_dir: Path,
    socket_dir: Path | None,
    read_only: list[Path],
    command: list[str],
    *,
    network: bool = False,
) -> list[str]:
    """``command`` in a bubblewrap sandbox (see the module doc); ``work_dir`` read-write at its own path.

    ``network``: keep the host's network namespace (a rank's box, whose ranks meet over TCP: ``rank_box``);
    else the box has none. ``socket_dir``: bound at ``INSIDE_SOCKET_DIR`` (a stage's proxy socket).
    """
    args = [
        shutil.which("bwrap") or "bwrap",
        "--unshare-all",  # user, ipc, pid, net, uts, cgroup namespaces
        *(["--share-net"] if network else []),
        "--unshare-user",
        "--uid",
        str(STAGE_UID),
        "--gid",
        str(STAGE_UID),
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        *system_binds(SYSTEM_ETC + NETWORK_ETC if network else SYSTEM_ETC),
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--tmpfs",
        "/tmp",
    ]
    for root in _code_roots():
        args += ["--ro-bind", str(root), str(root)]
    for path in read_only:
        args += ["--ro-bind", str(path), str(path)]
    args += ["--bind", str(work_dir), str(work_dir)]
    if socket_dir is not None:
        args += ["--bind", str(socket_dir), INSIDE_SOCKET_DIR]
    args += ["--chdir", str(work_dir), "--"]
    return args + command


def landlock_rules(
    work_dir: Path, private_dirs: list[Path], read_only: list[Path], *, network: bool = False
) -> dict[str, Any]:
    """What a stage in ``landlock`` mode may read and write (``landlock.enforce`` in the stage), and
    whether it keeps TCP (``network``: a rank's box)."""
    rules = landlock.rules(_code_roots(), work_dir, private_dirs, read_only)
    if not network:
        return rules
    names = [name for name in (*NETWORK_ETC, *NETWORK_SYS) if Path(name).exists()]
    return {**rules, "read": [*rules["read"], *names], "tcp_ports": list(ephemeral_range())}


def stage_environment(home: Path, tmp: str = "/tmp") -> dict[str, str]:
    """The whole environment of a stage process: nothing of the trainer's (no secret, no setting)."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "TMPDIR": tmp,
        "USER": "stage",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
    }


def _probe_bwrap(scratch: Path, network: bool = False) -> str:
    """Why bubblewrap cannot run a stage here ("" when it can): a real sandbox running the interpreter."""
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed"
    scratch.mkdir(parents=True, exist_ok=True)
    probe = [sys.executable, "-c", "import nebula_common"]
    command = bwrap_command(scratch, scratch, [], probe, network=network)
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=stage_environment(scratch)
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap did not start: {exc}"
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        return f"bubblewrap cannot create the namespaces here: {said[-1] if said else done.returncode}"
    return ""


def _probe_landlock(scratch: Path) -> tuple[int, str]:
    """The Landlock ABI a stage gets here and why not ("" when it does): a real process enforcing the
    stage's rules, then importing Nebula as a stage does."""
    version = landlock.abi()
    if version < 1:
        return 0, "the kernel has no Landlock (Linux 5.13 or newer with Landlock enabled)"
    work = scratch / "landlock"
    work.mkdir(parents=True, exist_ok=True)
    rules = json.dumps(landlock_rules(work, [], []))
    script = (
        "import json, sys\nfrom services.trainer import landlock\n"
        "landlock.enforce(json.loads(sys.argv[1]))\nimport nebula_common.proto.nebula.v1.trainer_pb2"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", script, rules],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            env=stage_environment(work, str(work)),
            cwd=work,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 0, f"a Landlock probe did not run: {exc}"
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        return 0, f"Landlock refused here: {said[-1] if said else done.returncode}"
    return version, ""


def choose_confinement(
    requested: str,
    scratch: Path,
    cgroup_parent: str = cgroup.PARENT,
    *,
    network: bool = False,
    setting: str = "NEBULA_TRAINER_STAGE_ISOLATION",
) -> Confinement:
    """The confinement for ``requested`` (``auto``: the strongest that works), probed for real.

    ``network``: boxes that keep TCP (a worker's rank boxes); ``setting``: the variable ``requested``
    came from, named in every message.
    """
    if requested not in MODES:
        expected = ", ".join(MODES)
        raise SandboxError(f"{setting}={requested!r}: expected one of {expected}")
    confinement = _choose(requested, scratch, cgroup.available(parent=cgroup_parent), network, setting)
    return dataclasses.replace(confinement, cgroup_parent=cgroup_parent, network=network)


def _choose(requested: str, scratch: Path, groups: str, network: bool, setting: str) -> Confinement:
    no_filter = seccomp_filter.unavailable()
    if requested == "process":
        return Confinement("process", f"{setting}=process", groups, seccomp_missing=no_filter)
    why = _probe_bwrap(scratch, network) if requested != "landlock" else f"{setting}=landlock"
    if not why:
        return Confinement("bwrap", "", groups, seccomp_missing=no_filter)
    if requested == "bwrap":
        raise SandboxError(f"{setting}=bwrap, but {why}")
    version, no_landlock = _probe_landlock(scratch)
    if not no_landlock:
        return Confinement("landlock", why, groups, landlock_abi=version, seccomp_missing=no_filter)
    if requested == "landlock":
        raise SandboxError(f"{setting}=landlock, but {no_landlock}")
    return Confinement("process", f"{why}; {no_landlock}", groups, seccomp_missing=no_filter)


__all__ = [
    "INSIDE_SOCKET_DIR",
    "Confinement",
    "SandboxError",
    "StageLimits",
    "bwrap_command",
    "choose_confinement",
    "landlock_rules",
    "stage_environment",
]
