"""Each service of a local deployment in a box of its own, so it can read only its own secrets.

Under ``nebula local up`` and ``nebula cluster up`` every process runs as the operator's user, so
file modes cannot keep one service from another's keys. Where Debian's bubblewrap can create
namespaces, the launcher starts auth, codec, data, the switch and the trainer each in its own user,
mount and PID namespaces, every capability dropped, with an empty root to which only these are added:

* read-only: the system's ``/usr`` (and its top-level links), the few ``/etc`` files the C library
  reads, the interpreter, the installed packages and Nebula's own packages (never the repository
  around them, whose ``runs/`` holds deployments);
* read-only: the service's own identity directory, where the launcher keeps a copy of the cluster
  CA's CRL (``mirror_crl``); the switch instead sees the cluster's whole PKI directory (its WAN
  certificate and key, the trust bundle, peers' CAs and CRLs, which ``nebula pki`` rewrites: the
  directory is bound, not its files, so what is renamed into it shows at once) *less* the CA key, the
  PKI's audit log and key and the other services' identities;
* read-write: the service's own state directory (auth's accounts and signing key, the switch's and
  the data service's audit logs and keys, datasets); auth also reads the admin password file;
* a private ``/tmp``, ``/dev`` and a ``/proc`` that shows only the service's own processes, so it
  cannot reach another process's memory or environment either.

bubblewrap loads a seccomp allow list (``nebula_common.seccomp.SERVICE``: systemd's ``@system-service``
set less the calls no service needs, no namespaces, no raw sockets) just before it executes the service.
The service is the namespace's first process (``--as-pid-1``), so the launcher signals it directly
(its pid comes from bubblewrap's ``--json-status-fd``) and a SIGTERM drains it as without the box.
The trainer's box differs (``trainer_box.py``): it makes its stages' boxes, so it may create
namespaces, and a root launcher runs it as a user of its own (``userns.py``, ``box_entry.py``).
Where bubblewrap is missing or may not create namespaces, services run unboxed and ``describe()``
says so (``nebula local status``); ``NEBULA_REQUIRE_BWRAP=1`` turns that into an error.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from nebula_common import seccomp
from nebula_common.bwrap import code_roots, system_binds
from nebula_common.errors import NebulaError
from nebula_common.launcher import userns
from nebula_common.pki.store import ClusterPaths

SERVICE_ETC = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/localtime",
    "/etc/nsswitch.conf",
    "/etc/hosts",
    "/etc/host.conf",
    "/etc/passwd",
    "/etc/group",
    "/etc/ssl/certs",
)
"""What of /etc a service reads: the loader's, the resolver's (``localhost``) and the user database."""
REQUIRE_ENV = "NEBULA_REQUIRE_BWRAP"
SYSTEM_TOPS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc", "/proc", "/dev")
"""What ``system_binds`` and the box's own mounts make: never made again as plain folders (nor ``/tmp``)."""
HOST_PROC_SIDE = "/run/nebula-host-proc"
"""Where a nesting box shows the host's /proc until ``box_entry`` has mounted its own and detached this."""
PROBE_TIMEOUT_S = 30.0


class ServiceBoxError(NebulaError):
    """A box was required (``NEBULA_REQUIRE_BWRAP=1``) but cannot be had here; the message says why."""


@dataclass(frozen=True)
class ServiceBox:
    """What one service sees besides the system and the code (see the module doc)."""

    read_only: tuple[Path, ...] = ()
    read_write: tuple[Path, ...] = ()
    hidden: tuple[Path, ...] = ()
    """Inside a read-only directory: hidden (a directory becomes empty, a file a device node it may not
    open: its box's mounts are ``nodev``)."""
    shown: tuple[Path, ...] = ()
    """Bound read-only again inside a hidden directory (the service's own identity)."""
    nests: bool = False
    """The service makes bubblewrap boxes of its own (the trainer, for its stages): no seccomp filter
    (it must create namespaces), and, when the launcher is root, the ``box_entry`` set-up below."""
    user: int = userns.TRAINER_UID
    """Who a nesting service runs as when the launcher is root (``box_entry``); else the launcher's user."""

    def argv(self, status_fd: int, seccomp_fd: int | None = None, userns_fd: int | None = None) -> list[str]:
        """bubblewrap's arguments up to ``--``; it writes ``{"child-pid": N}`` to ``status_fd`` and, with
        ``seccomp_fd``, loads the filter compiled there (``nebula_common.seccomp``) before the service.
        ``userns_fd`` (a root launcher's, ``userns.user_namespace``): the box's user namespace."""
        args = [
            shutil.which("bwrap") or "bwrap",
            *(["--userns", str(userns_fd)] if userns_fd is not None else ["--unshare-user"]),
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--as-pid-1",
            "--die-with-parent",
            "--cap-drop",
            "ALL",
            "--json-status-fd",
            str(status_fd),
            *(["--perms", "0755", "--dir", "/etc"] if self.nests else []),  # else made 0700, by root
            *system_binds(SERVICE_ETC),
        ]
        if self.nests and userns_fd is not None:  # box_entry mounts /proc, then drops these
            for capability in ("CAP_SYS_ADMIN", "CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP"):
                args += ["--cap-add", capability]
            args += ["--bind", "/proc", HOST_PROC_SIDE, "--tmpfs", "/proc"]
        else:
            args += ["--proc", "/proc"]
        args += ["--dev", "/dev", "--perms", "01777", "--tmpfs", "/tmp"]  # the box's own, for any user of it
        code = _code_binds()
        if self.nests:  # the box's own folders above what it binds, searchable by the service's user
            args += _searchable_parents([Path(p) for p in code[2::3]] + [*self.read_write, *self.read_only])
        args += code
        for path in self.read_write:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            args += ["--bind", str(path), str(path)]
        for path in self.read_only:
            args += ["--ro-bind", str(path), str(path)]
        for path in self.hidden:
            if path.is_dir():
                args += ["--tmpfs", str(path)]  # private and empty: what the box writes there goes nowhere
            elif path.exists():
                args += ["--ro-bind", "/dev/null", str(path)]
        for path in self.shown:
            args += ["--ro-bind", str(path), str(path)]
        if seccomp_fd is not None:
            args += ["--seccomp", str(seccomp_fd)]
        return [*args, "--chdir", "/tmp", "--"]

    def command(self, command: list[str], userns_fd: int | None, lifeline_fd: int | None = None) -> list[str]:
        """What the box executes: ``command``, behind ``box_entry`` for a nesting service (its PID 1; with a
        root launcher's namespace also its own ``/proc`` and user). ``lifeline_fd``: the read end of a pipe
        whose write end only the launcher holds; the box ends with the launcher (``box_entry`` step 5)."""
        if not self.nests:
            return command
        entry = [sys.executable, "-m", "nebula_common.launcher.box_entry"]
        if userns_fd is not None:
            entry += ["--setup", HOST_PROC_SIDE, str(self.user)]
        if lifeline_fd is not None:
            entry += ["--lifeline", str(lifeline_fd)]
        return [*entry, "--", *command]


def for_service(
    service: str,
    own: Path | None,
    pki: ClusterPaths | None,
    state_dir: Path | None,
    files: tuple[Path, ...] = (),
    writable: tuple[Path, ...] = (),
) -> ServiceBox:
    """What ``service`` sees: its state directory, ``files``, its identity ``own`` and, for the switch,
    its cluster's PKI directory ``pki`` less others' secrets."""
    read_only, hidden, shown = list(files), [], []
    if pki is not None and service == "switch":
        # The switch reads its WAN certificate and key, the trust bundle, peers' CAs and CRLs from
        # the cluster's directory, which the operator's `nebula pki` and the launcher rewrite: the
        # directory is bound (a file bound alone would keep its old contents), less the CA key
        # (written once, at `pki init`), the PKI's audit log and key, and other services' identities.
        read_only.append(pki.dir)
        hidden += [pki.ca_key, pki.audit_dir]
        if own is not None:
            hidden.append(own.parent)
            shown.append(own)
    elif own is not None:  # its identity and its copy of the CRL (``mirror_crl``): nothing else
        read_only.append(own)
    writable = ((state_dir,) if state_dir is not None else ()) + writable
    return ServiceBox(tuple(read_only), writable, tuple(hidden), tuple(shown))


def _searchable_parents(paths: list[Path]) -> list[str]:
    """``--dir`` with mode 0755 for every folder above ``paths`` that the box does not have yet.

    bubblewrap makes a bound path's missing parents with the host's modes, so an interpreter under
    ``/root`` (0700) would be out of reach of a service that is not root. These are the box's own empty
    folders (a tmpfs): opening them shows nothing of the host.
    """
    made: list[str] = []
    for path in paths:
        for parent in reversed(path.parents[:-1]):  # top-down, without "/"
            name = str(parent)
            system = name == "/tmp" or any(name == top or name.startswith(top + "/") for top in SYSTEM_TOPS)
            if name not in made and not system:
                made.append(name)
    args: list[str] = []
    for name in made:
        args += ["--perms", "0755", "--dir", name]
    return args


def _code_binds() -> list[str]:
    import nebula_common
    import services

    args = []
    for root in code_roots((nebula_common, services)):
        args += ["--ro-bind", str(root), str(root)]
    return args


@functools.cache
def unavailable() -> str:
    """Why services cannot be boxed here ("" when they can): bubblewrap missing or refused namespaces."""
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed"
    read, write = os.pipe()
    try:
        command = [*ServiceBox().argv(write), "/usr/bin/env", "true"]
        result = subprocess.run(
            command, pass_fds=(write,), capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap could not be run: {exc}"
    finally:
        os.close(write)
        os.close(read)
    if result.returncode != 0:
        return f"bubblewrap may not create namespaces here: {result.stderr.strip() or result.returncode}"
    return ""


FILTER_PROBE = (
    "import ctypes, socket\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "if libc.unshare(0x10000000) == 0 or ctypes.get_errno() != 1:\n"
    "    raise SystemExit(f'unshare was not refused (errno {ctypes.get_errno()})')\n"
    "socket.socket(socket.AF_INET, socket.SOCK_DGRAM).close()\n"  # the resolver's UDP stays
)
"""Run in a filtered probe box: a call the filter denies fails with EPERM, one it allows works."""


@functools.cache
def filter_missing() -> str:
    """Why boxed services get no seccomp filter here ("" when they do): a real probe box loading it."""
    if why := unavailable():
        return why
    if why := seccomp.unavailable(seccomp.SERVICE):
        return why
    read, write = os.pipe()
    program = seccomp.program_fd(seccomp.SERVICE)
    try:
        command = [*ServiceBox().argv(write, program), sys.executable, "-c", FILTER_PROBE]
        result = subprocess.run(
            command,
            pass_fds=(write, program),
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"a filtered probe box could not be run: {exc}"
    finally:
        for fd in (write, read, program):
            os.close(fd)
    if result.returncode != 0:
        said = (result.stderr or result.stdout).strip().splitlines()
        return f"bubblewrap could not load the filter: {said[-1] if said else result.returncode}"
    return ""


def boxes_enabled() -> bool:
    """True where services can be boxed; raises when required (``NEBULA_REQUIRE_BWRAP=1``) but not."""
    why = unavailable()
    if why and os.environ.get(REQUIRE_ENV) == "1":
        raise ServiceBoxError(f"{REQUIRE_ENV}=1, but the services cannot be boxed: {why}")
    return not why


def describe(enabled: bool) -> str:
    """One line for ``nebula local status``: what keeps each service from the others' keys."""
    if enabled:
        missing = filter_missing()
        calls = (
            f"seccomp allows {len(seccomp.allowed(seccomp.SERVICE))} system calls"
            if not missing
            else f"no seccomp filter ({missing})"
        )
        trainer_user = (
            f"as user {userns.TRAINER_UID}, not root, " if os.geteuid() == 0 else "as the launcher's user, "
        )
        return (
            "bwrap: the audit signer, auth, codec, data, the switch and the trainer each see only their own "
            f"keys and state (own user, mount and PID namespaces; {calls}; no service reads its audit seal "
            f"key); the trainer {trainer_user}with no seccomp filter of its own (it makes its stages' boxes, "
            "which carry theirs)"
        )
    return f"none ({unavailable()}): every service can read every key of the run directory"
