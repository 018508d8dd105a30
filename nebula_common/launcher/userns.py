"""A user namespace for one box of a root-run deployment, in which the trainer's own user exists too.

Why: run as root, the launcher gives the trainer a user of its own (``TRAINER_UID``) so that, even
inside its box, it is not the host's root (root, capabilities or not, may write the kernel's settings
under ``/proc/sys`` wherever a ``/proc`` is not covered, and the trainer needs an uncovered one to make
its stages' boxes). bubblewrap maps only its caller's user into a namespace it creates, so the
namespace is made here instead, mapping root and ``TRAINER_UID`` each to themselves, and handed to
bubblewrap (``--userns``): bubblewrap sets the box up as root (it can reach the trainer's directories,
which belong to ``TRAINER_UID``, and the other services' ones), and the trainer's entry
(``box_entry``) then becomes ``TRAINER_UID`` before anything of the trainer runs. The other services'
boxes get the same kind of namespace so that their bubblewrap can reach what lies under the trainer's
directory (the trainer's audit signer socket) and what it owns, as root, without any capability
inside.
"""

from __future__ import annotations

import os
import subprocess
import sys

from nebula_common.errors import NebulaError

TRAINER_UID = 47000
"""The host user and group id a boxed trainer runs as when the launcher is root (not a user of the host's
user database: nothing but the trainer's own files belong to it)."""
START_TIMEOUT_S = 20.0

_CHILD = (
    "import ctypes, sys\n"
    "if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) != 0:\n"  # CLONE_NEWUSER
    "    raise SystemExit(f'unshare(CLONE_NEWUSER) failed: errno {ctypes.get_errno()}')\n"
    "sys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdin.read()\n"
)


class UserNamespaceError(NebulaError):
    """The namespace could not be made (the message says why)."""


def user_namespace(*uids: int) -> int:
    """A descriptor of a new user namespace mapping root and each of ``uids`` to itself (the caller
    closes it). Needs root: only a process holding CAP_SETUID and CAP_SETGID may map other users."""
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        if child.stdout.readline() != b"ready\n":
            child.wait(START_TIMEOUT_S)
            said = child.stderr.read().decode(errors="replace").strip() if child.stderr else ""
            raise UserNamespaceError(f"a user namespace could not be made: {said or child.returncode}")
        lines = "".join(f"{uid} {uid} 1\n" for uid in sorted({0, *uids}))
        try:
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{child.pid}/{name}", "w") as table:
                    table.write(lines)
            return os.open(f"/proc/{child.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise UserNamespaceError(f"the user namespace's map could not be written: {exc}") from None
    finally:
        if child.stdin is not None:
            child.stdin.close()
        try:
            child.wait(START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


__all__ = ["TRAINER_UID", "UserNamespaceError", "user_namespace"]
