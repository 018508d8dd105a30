"""The first code run in a box whose service makes boxes of its own (the trainer, for its stages).

A process may mount a fresh ``/proc`` for a new PID namespace only where the namespace it lives in
already shows a whole ``/proc`` (nothing mounted over any of it). bubblewrap, run as root, covers
``/proc/sys`` and a few other entries of the ``/proc`` it mounts, which is right for a service that
makes no boxes, but then the stages' bubblewrap may not mount theirs. So the trainer's box starts with
the host's ``/proc`` at a side path and an empty ``/proc``, and this entry, still root inside the box:

1. mounts the box's own ``/proc`` (its PID namespace only; allowed because the side path shows a whole one);
2. detaches the side path, so nothing of the host's processes is left in sight;
3. becomes the trainer's own user (``userns.TRAINER_UID``), dropping every capability, the bounding
   set included, and sets ``no_new_privs``;
4. runs the service as its only child, staying the box's PID 1 to reap what the stages' boxes leave
   (``init``; a non-root launcher's trainer box uses only this step);
5. holds the read end of the launcher's *lifeline*, a pipe whose write end only the launcher has: when
   the launcher ends in any way (``kill -9`` included) the pipe reads end-of-file and this entry exits,
   and the kernel kills everything left in the box's PID namespace, stage boxes and their work included.
   bubblewrap's ``--die-with-parent`` cannot do this for a root launcher: the parent-death signal is
   cleared when step 3 changes the user, and set again it would come from bubblewrap, a process of
   root's that has no capability left to signal another user's process.

The fresh ``/proc`` is uncovered but harmless to a process that is neither root nor capable: the kernel's
settings under it are writable by the host's root only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x2, 0x4, 0x8
MNT_DETACH = 2
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
LAST_CAPABILITY = 63
CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = tuple((name, ctypes.c_uint32) for name in ("effective", "permitted", "inheritable"))


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise SystemExit(f"box entry: {what} failed: {os.strerror(errno)} (errno {errno})")


def enter(side: str, uid: int) -> None:
    """Steps 1-3 of the module doc, in this process."""
    libc = ctypes.CDLL(None, use_errno=True)
    _check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "mount /proc")
    _check(libc.umount2(side.encode(), MNT_DETACH), f"detach {side}")
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    for capability in range(LAST_CAPABILITY + 1):  # needs CAP_SETPCAP; beyond the kernel's last: EINVAL
        libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0)
    _check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient capabilities")
    os.setresuid(uid, uid, uid)  # from root to another user: permitted and effective sets are cleared
    header = _CapHeader(CAPABILITY_VERSION_3, 0)
    _check(libc.capset(ctypes.byref(header), (_CapData * 2)()), "clear the inheritable capabilities")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    with open("/proc/self/status") as status:
        sets = [line.split() for line in status if line.startswith("Cap")]
    if any(int(value, 16) for _, value in sets):
        raise SystemExit(f"box entry: capabilities are left after the switch of user: {sets}")


FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


LAUNCHER_GONE = 137
"""The entry's status when its launcher went away: as if killed (128 + SIGKILL), which it is in effect."""


def _watch_lifeline(fd: int) -> None:
    """Exit this process (the box's PID 1, so the whole box) once the launcher's end of ``fd`` closes."""
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass
    os._exit(LAUNCHER_GONE)


def init(command: list[str], lifeline: int | None = None) -> int:
    """Run ``command`` as this box's only child and be its PID 1: forward signals, reap every orphan.

    Why not execute the service as PID 1 itself: a stage's bubblewrap leaves a process behind that
    the kernel hands to PID 1, and a Python service never waits for processes it did not start, so
    they would pile up as zombies for as long as the trainer runs. Returns the exit status the
    service's own would give the launcher (128 + the signal that ended it). ``lifeline``: step 5.
    """
    if lifeline is not None:
        os.set_inheritable(lifeline, False)  # the service must not hold the box open on its own
    child = os.fork()
    if child == 0:
        try:
            os.execv(command[0], command)
        finally:
            os._exit(127)
    for signum in FORWARDED:
        signal.signal(signum, lambda received, _frame: os.kill(child, received))
    # The launcher starts a service with its stop signals blocked until the service handles them
    # (``stop_signals.py``); the service, our child, unblocks its own. Here they are handled now: one that
    # came early is forwarded at once, and the child holds it until it is ready, as without this entry.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    if lifeline is not None:
        threading.Thread(target=_watch_lifeline, args=(lifeline,), name="lifeline", daemon=True).start()
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def main(argv: list[str]) -> None:
    """``[--setup SIDE UID] [--lifeline FD] -- COMMAND...``: steps 1-3 with ``--setup`` (a root
    launcher), then ``init``, watching ``FD`` (step 5) when given."""
    usage = (
        "usage: python -m nebula_common.launcher.box_entry [--setup SIDE UID] [--lifeline FD] -- COMMAND..."
    )
    setup = lifeline = None
    if argv[:1] == ["--setup"]:
        if len(argv) < 3 or not argv[2].isdigit():
            raise SystemExit(usage)
        setup, argv = (argv[1], int(argv[2])), argv[3:]
    if argv[:1] == ["--lifeline"]:
        if len(argv) < 2 or not argv[1].isdigit():
            raise SystemExit(usage)
        lifeline, argv = int(argv[1]), argv[2:]
        try:
            os.fstat(lifeline)
        except OSError as exc:
            said = f"box entry: the lifeline {lifeline} is not an open file: {exc.strerror}"
            raise SystemExit(said) from None
    if len(argv) < 2 or argv[0] != "--":
        raise SystemExit(usage)
    if setup is not None:
        enter(*setup)
    sys.exit(init(argv[1:], lifeline))


if __name__ == "__main__":
    main(sys.argv[1:])
