"""A rank's box: one stage's part on one cluster rank, confined, with its stage's store keys only.

Started by a worker (``rank_box``) as ``python -m services.trainer.rank_box_main CONTROL STORE PARENT``:
``CONTROL`` brings its settings and the spec, ``STORE`` is its stage's keys of the rank store
(``runtime/store_bridge``), ``PARENT`` the worker's pid (it dies with it). Before the job's code
is loaded it limits itself, forbids ptrace, core dumps and new privileges, loads its seccomp filter
and, in ``landlock`` mode, its Landlock rules (``stage_main.confine``, as a trainer's stage does).
Then it forms the stage's compute group with the stage's other ranks (``compute/`` of the stage's
keys) and follows the driver (``rank_main.follow``). It says why it failed in the stage's keys
(``error/<rank>``) and exits non-zero; zero when the driver stopped it.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import sys
from multiprocessing.connection import Connection
from pathlib import Path

PR_SET_PDEATHSIG = 1
MAX_SPEC_BYTES = 64 << 20


def main(argv: list[str]) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the worker's death is this box's
    parent = int(argv[3])  # 0 under bubblewrap, whose --die-with-parent does the same
    if parent and os.getppid() != parent:
        return 3  # the worker died before the signal was armed
    from services.trainer.stage_channel import parse_json

    control = Connection(int(argv[1]))
    config = parse_json(control.recv_bytes(1 << 20))
    spec = control.recv_bytes(MAX_SPEC_BYTES)
    control.close()
    from services.trainer.stage_main import confine

    confine(config["limits"])
    if config.get("seccomp"):
        from services.trainer import seccomp_filter

        seccomp_filter.enforce()
    if config.get("landlock"):  # before any thread and any of the job's code
        from services.trainer import landlock

        landlock.enforce(config["landlock"])
    return run(Connection(int(argv[2])), config, spec)


def run(conn: Connection, config: dict[str, object], spec: bytes) -> int:
    import torch
    import torch.distributed as dist

    from services.trainer.runtime.rank_main import follow, join_commands, join_compute_group, report_failure
    from services.trainer.runtime.store_bridge import BridgedStore

    rank, world = int(config["rank"]), int(config["world"])  # type: ignore[call-overload]
    timeout = float(config["timeout"])  # type: ignore[arg-type]
    torch.set_num_threads(int(config["threads"]))  # type: ignore[call-overload]
    store = BridgedStore(conn)
    store.set_timeout(datetime.timedelta(seconds=timeout))
    try:
        commands = join_commands(store, rank, world, timeout)  # first: see join_commands
        join_compute_group(dist.PrefixStore("compute/", store), rank, world, timeout)
        data_dir, owner = Path(str(config["data_dir"])), str(config["owner"])
        follow(spec, rank, world, store, data_dir, owner, timeout, commands)
    except Exception as exc:
        report_failure(store, rank, exc)
        print(f"rank {rank}: the stage failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the job's own threads (a stuck one included) end with the process
