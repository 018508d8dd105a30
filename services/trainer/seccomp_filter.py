"""The system calls a stage process may make: a seccomp allow list loaded before the job's code.

The stage's policy over ``nebula_common.seccomp`` (systemd's ``@system-service`` set less ``DENIED``):
plus the stage's own Landlock calls, and ``socket`` only for Unix, netlink and TCP sockets (no UDP,
which Landlock covers only from ABI 10, no raw, packet or other family).

The stage's entry point (``stage_main``) loads it after its limits and ``PR_SET_NO_NEW_PRIVS`` and
before Landlock and the job's module; every process the stage starts inherits it. The trainer probes
it at start-up (``sandbox.choose_confinement``) and says when stages run without it.
"""

from __future__ import annotations

import subprocess
import sys

from nebula_common import seccomp
from nebula_common.seccomp import DENIED

STAGE_OWN = ("landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self")
"""Calls outside ``@system-service`` the stage itself makes: its Landlock rules, after this filter."""
STAGE = seccomp.Policy(extra=STAGE_OWN)


def allowed() -> tuple[str, ...]:
    """The names the stage's filter allows."""
    return seccomp.allowed(STAGE)


def enforce() -> int:
    """Load the filter into this process (and its future children); returns how many calls it allows.

    Needs ``PR_SET_NO_NEW_PRIVS`` (or ``CAP_SYS_ADMIN``): ``stage_main.confine`` sets it first.
    """
    rules, count = seccomp.build(STAGE)
    rules.load()
    return count


def unavailable() -> str:
    """Why stages cannot get the filter here ("" when they can): a real child process loading it."""
    script = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "assert libc.prctl(38, 1, 0, 0, 0) == 0, 'PR_SET_NO_NEW_PRIVS'\n"
        "from services.trainer import seccomp_filter\nseccomp_filter.enforce()\n"
        "if libc.unshare(0x10000000) == 0:\n    raise SystemExit('unshare was allowed under the filter')\n"
        "assert ctypes.get_errno() == 1, ctypes.get_errno()\n"
    )
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"a seccomp probe did not run: {exc}"
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        return f"seccomp cannot be loaded here: {said[-1] if said else done.returncode}"
    return ""


__all__ = ["DENIED", "STAGE", "allowed", "enforce", "unavailable"]
