"""A stage's box where bubblewrap cannot run: Landlock, the kernel's sandbox for unprivileged processes.

Containers (compose, Kubernetes) may not create namespaces, so bubblewrap cannot start there; but any
process may restrict itself with Landlock (Linux 5.13 and newer, allowed by the default seccomp
profiles of podman, Docker and containerd). ``stage_main`` enforces the rules below on itself before
the job's code is loaded, through ``landlockpy`` (bindings with no dependencies; the kernel does the
work), and they hold for everything the stage starts:

* files: read (and execute) only the interpreter, the installed packages, Nebula's own packages,
  the system's libraries and a few harmless files of ``/etc``, the pre-trained folders its spec
  declares, its own ``/proc/<pid>``; read and write only its account's directory, a private
  temporary directory and its proxy socket's directory. No key, password, record or other account's
  directory is reachable, whatever the file permissions say;
* network (ABI 4): no TCP connect or bind at all (its way out is the trainer's Unix socket); a rank's
  box (``rank_box``) connects only to ports of its host's ephemeral range (``tcp_ports``), where its
  ranks' gloo and NCCL listen, and never to a service's or a rank store's port, all outside it;
* processes (ABI 6): no signal to, and no abstract Unix socket of, anything outside its own box;
  Landlock always forbids ptrace (and so ``/proc/<pid>/mem`` and ``environ``) of processes outside it.

What an older kernel's ABI does not cover is named by ``gaps`` and reported with the trainer's mode.
Unlike bubblewrap it leaves the stage the trainer's user, the host's process list (no ``/proc`` to read
it with, though) and UDP (ABI 10 closes it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import landlockpy
from landlockpy import AccessFS, AccessNet, Ruleset, Scope

READ = AccessFS.READ_FILE | AccessFS.READ_DIR | AccessFS.EXECUTE
DEVICES = {"/dev/null": "rw", "/dev/zero": "r", "/dev/urandom": "r", "/dev/random": "r"}
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/sys/devices/system/cpu")
ETC = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/nsswitch.conf",
    "/etc/passwd",
    "/etc/group",
)
PROC = ("/proc/cpuinfo", "/proc/meminfo", "/proc/stat")


def abi() -> int:
    """The running kernel's Landlock ABI version (0: none)."""
    try:
        return landlockpy.abi_version()
    except OSError:
        return 0


TCP_ABI = 4
"""The first Landlock ABI that can deny TCP connect and bind (Linux 6.7)."""


def gaps(version: int) -> list[str]:
    """What Landlock of ABI ``version`` leaves a stage (empty from ABI 6 on, but for UDP)."""
    missing = []
    if version < TCP_ABI:
        missing.append("TCP connections (needs Landlock ABI 4, Linux 6.7)")
    if version < 6:
        missing.append("signals to other processes of its user (needs Landlock ABI 6, Linux 6.12)")
    return missing


def rules(
    code_roots: list[Path], work_dir: Path, private_dirs: list[Path], read_only: list[Path]
) -> dict[str, list[str]]:
    """The paths a stage may read and those it may write, as ``stage_main`` gets them (JSON)."""
    readable = [str(p) for p in code_roots]
    readable += [p for p in (*SYSTEM, *ETC, *PROC) if os.path.exists(p)]
    readable += [str(p) for p in read_only]
    writable = [str(work_dir), *(str(p) for p in private_dirs)]
    return {"read": readable, "write": writable}


def enforce(allowed: dict[str, Any]) -> int:
    """Restrict this process (which must have no other thread) and its future children; its ABI.

    Raises ``OSError`` when the kernel refuses, and ``RuntimeError`` without Landlock: a stage never
    runs with less than its trainer announced.
    """
    version = abi()
    if version < 1:
        raise RuntimeError("Landlock is not available in this kernel")
    ports = allowed.get("tcp_ports")
    if "read" not in allowed:  # a bubblewrap box's TCP rule alone (``rank_box``): its files are bwrap's
        return _enforce_tcp_ports(ports)
    # A rank's box keeps TCP connections to ``tcp_ports`` only: its ranks meet over it (``rank_box``).
    tcp = AccessNet.CONNECT_TCP if ports else AccessNet.BIND_TCP | AccessNet.CONNECT_TCP
    with Ruleset(
        handled_fs=landlockpy.fs_for_abi(version),
        handled_net=tcp | AccessNet.BIND_UDP,
        scoped=Scope.ABSTRACT_UNIX_SOCKET | Scope.SIGNAL,
    ) as ruleset:
        _allow_ports(ruleset, ports)
        everything = ruleset.handled_fs
        for path in [*allowed["read"], f"/proc/{os.getpid()}"]:
            if os.path.exists(path):
                ruleset.allow_path(path, READ if os.path.isdir(path) else _file_rights(READ))
        for path in allowed["write"]:
            ruleset.allow_path(path, everything)
        for device, mode in DEVICES.items():
            if os.path.exists(device):
                writes = AccessFS.WRITE_FILE | AccessFS.IOCTL_DEV if mode == "rw" else AccessFS.NONE
                ruleset.allow_path(device, AccessFS.READ_FILE | writes)
        ruleset.restrict()
    return version


def _allow_ports(ruleset: Ruleset, ports: list[int] | None) -> None:
    """TCP connections to ``ports`` (an inclusive [low, high]: the host's ephemeral range, where the
    ranks' gloo and NCCL listen) and to no other port: not the rank stores, not any service."""
    if ports:
        for port in range(int(ports[0]), int(ports[1]) + 1):
            ruleset.allow_port(port, AccessNet.CONNECT_TCP)


def _enforce_tcp_ports(ports: list[int] | None) -> int:
    version = abi()
    if not ports or version < TCP_ABI:
        raise RuntimeError(f"Landlock ABI {version} cannot limit TCP connections (needs {TCP_ABI})")
    with Ruleset(handled_fs=AccessFS.NONE, handled_net=AccessNet.CONNECT_TCP) as ruleset:
        _allow_ports(ruleset, ports)
        ruleset.restrict()
    return version


def _file_rights(rights: AccessFS) -> AccessFS:
    """Landlock refuses directory-only rights on a file."""
    return rights & (AccessFS.READ_FILE | AccessFS.EXECUTE | AccessFS.WRITE_FILE | AccessFS.TRUNCATE)


__all__ = ["abi", "enforce", "gaps", "rules"]
