"""The system calls a stage process may not make: a seccomp filter loaded before the job's code.

Namespaces, Landlock and file permissions decide what a stage can reach; this filter shrinks what it
can ask the kernel for at all, so a kernel bug behind a rarely needed call is out of its reach too. It
is a deny list (everything else is allowed: a training job's Python, torch and gloo use a wide and
changing set of calls), in the spirit of Docker's and Podman's default profiles, built and loaded with
libseccomp (``pyseccomp`` bindings). A denied call fails with ``EPERM`` (``clone3`` with ``ENOSYS``, so
the C library falls back to ``clone``, whose namespace flags the filter can see), never kills: job code
that probes gets an error it can report.

The stage's entry point (``stage_main``) loads it after its limits and ``PR_SET_NO_NEW_PRIVS`` and
before Landlock and the job's module; every process the stage starts inherits it. The trainer probes
it at start-up (``sandbox.choose_confinement``) and says when stages run without it.
"""

from __future__ import annotations

import errno
import subprocess
import sys

DENIED: dict[str, str] = {
    **dict.fromkeys(("ptrace", "process_vm_readv", "process_vm_writev", "kcmp"), "other processes' memory"),
    **dict.fromkeys(
        (
            "mount",
            "umount2",
            "pivot_root",
            "chroot",
            "move_mount",
            "open_tree",
            "fsopen",
            "fsconfig",
            "fsmount",
            "fspick",
            "mount_setattr",
        ),
        "the filesystem's shape",
    ),
    **dict.fromkeys(("unshare", "setns"), "new or other namespaces"),
    **dict.fromkeys(("keyctl", "add_key", "request_key"), "kernel keyrings"),
    **dict.fromkeys(
        ("bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register"),
        "kernel attack surface no training job needs",
    ),
    **dict.fromkeys(
        (
            "kexec_load",
            "kexec_file_load",
            "init_module",
            "finit_module",
            "delete_module",
            "reboot",
            "swapon",
            "swapoff",
            "acct",
            "quotactl",
            "syslog",
            "settimeofday",
            "clock_settime",
            "clock_adjtime",
            "adjtimex",
            "sethostname",
            "setdomainname",
            "iopl",
            "ioperm",
            "open_by_handle_at",
            "name_to_handle_at",
            "vhangup",
        ),
        "the host's administration",
    ),
}
"""Denied system call -> what it would reach."""
CLONE_NAMESPACE_FLAGS = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
    0x00000080,  # CLONE_NEWTIME
)


def enforce() -> int:
    """Load the filter into this process (and its future children); returns how many calls it denies.

    Calls this kernel's architecture does not have are skipped. Needs ``PR_SET_NO_NEW_PRIVS`` (or
    ``CAP_SYS_ADMIN``): ``stage_main.confine`` sets it first.
    """
    import pyseccomp as seccomp

    refused = seccomp.ERRNO(errno.EPERM)
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    denied = 0
    for name in DENIED:
        try:
            rules.add_rule(refused, name)
        except (OSError, ValueError):  # unknown on this architecture
            continue
        denied += 1
    for flag in CLONE_NAMESPACE_FLAGS:  # clone's flags are its first argument on x86-64 and arm64
        rules.add_rule(refused, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    rules.load()
    return denied + 2


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
