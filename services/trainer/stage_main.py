"""A stage process: one stage of one job, confined, talking only to its trainer (``stage_process``).

Started by the trainer as ``python -m services.trainer.stage_main FD`` (inside bubblewrap where the host
allows it, else under Landlock it enforces on itself: ``sandbox``), with an empty environment and the
control channel on ``FD``. Before anything of the job is loaded it limits itself (memory, CPU seconds,
open files), forbids ptrace, core dumps and new privileges, and loads its system-call filter
(``seccomp_filter``); then it runs the same ``ProgramRunner`` a trainer thread used to run, with its
edges and dataset reads going to the trainer's proxy socket under the stage's secret (``stage_proxy``)
or, with a switch edge socket, its edges as records on connections the trainer passes it (``stage_edge_fds``),
its status board and step numbers to the trainer over the channel, and its checkpoints into its
account's directory. A stage on the cluster's ranks also gets its ranks through the trainer
(``runtime/boxed_ranks``: asked over the channel, its stage's store keys on two more socketpairs) and
keeps TCP to the host's ephemeral ports, where it meets them. It exits when the stage has ended.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
log = logging.getLogger("services.trainer.stage")


def confine(limits: dict[str, int]) -> None:
    """Limits and process flags the job's code cannot undo (lowering is one-way for it)."""
    if limits.get("memory_bytes"):
        resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"], limits["memory_bytes"]))
    if limits.get("cpu_seconds"):
        # The soft limit sends SIGXCPU (handled: the stage fails saying why); the hard one kills.
        cpu = limits["cpu_seconds"]
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 5))
    if limits.get("open_files"):
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"], limits["open_files"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    libc = ctypes.CDLL(None, use_errno=True)  # the C library the interpreter is linked with
    for option, value in ((PR_SET_DUMPABLE, 0), (PR_SET_NO_NEW_PRIVS, 1)):
        if libc.prctl(option, value, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"prctl({option}, {value}) failed")


def main(argv: list[str]) -> int:
    from services.trainer import stage_channel as channel

    conn = Connection(int(argv[1]))
    channel.send(conn, channel.HELLO)
    kind, payload = channel.receive(conn)
    if kind != channel.START:
        return 2
    config = channel.parse_json(payload)
    kind, payload = channel.receive(conn)
    if kind != channel.SPEC:
        return 2
    confine(config["limits"])
    if config.get("seccomp"):  # after PR_SET_NO_NEW_PRIVS, before Landlock (whose calls it allows)
        from services.trainer import seccomp_filter

        seccomp_filter.enforce()
    if config.get("landlock"):  # before the job's code, and before any thread: it binds this one
        from services.trainer import landlock

        landlock.enforce(config["landlock"])
    return run(conn, config, payload)


def run(conn: Connection, config: dict[str, Any], spec_bytes: bytes) -> int:
    """The stage's body; the job's module is loaded only from here on (by ``ProgramRunner``)."""
    import torch

    from nebula_common.logging import configure_logging
    from nebula_common.proto.nebula.v1 import trainer_pb2
    from services.trainer import stage_channel as channel
    from services.trainer.edge import EdgeSettings
    from services.trainer.runtime.stage import ProgramRunner

    configure_logging("trainer", config.get("log_level", "INFO"))
    torch.set_num_threads(int(config["torch_threads"]))
    spec = trainer_pb2.StageSpec.FromString(spec_bytes)
    send_lock = threading.Lock()
    epoch_ok = threading.Event()

    def send(kind: bytes, payload: bytes) -> None:
        with send_lock:
            channel.send(conn, kind, payload)

    def on_epoch(epoch: int) -> None:
        """The trainer stores the epoch before any item of it is sent (``records``)."""
        epoch_ok.clear()
        with send_lock:
            channel.send_json(conn, channel.EPOCH, {"epoch": epoch})
        if not epoch_ok.wait(60):
            raise RuntimeError(f"the trainer did not store epoch {epoch} within 60 s")

    def on_step(job_id: str, stage: str, elapsed: float, waited: float, loss: float | None) -> None:
        with send_lock:
            channel.send_json(conn, channel.STEP, {"elapsed": elapsed, "waited": waited, "loss": loss})

    address = f"unix:{config['socket']}"
    edge_factory = None
    if config.get("edge_fds") is not None:  # edges as records on connections the trainer passes us
        import socket

        from services.trainer.edge import records_edge_factory
        from services.trainer.edge.socket_request import EdgeSocketRequester

        edge_factory = records_edge_factory(
            EdgeSocketRequester(socket.socket(fileno=int(config["edge_fds"])))
        )
    asker, cluster_ranks = _cluster_ranks(config, spec, send)
    runner = ProgramRunner(
        spec,
        config["secret"],  # the proxy's key; the owner's token stays with the trainer
        address,
        Path(config["data_dir"]),
        config["owner"],
        address if spec.program.dataset else None,
        edge_settings=EdgeSettings(**config["edge_settings"]),
        epoch=int(config["epoch"]),
        on_epoch=on_epoch,
        receive_ahead=config.get("receive_ahead"),
        step_sink=on_step,
        edge_factory=edge_factory,
        cluster_ranks=cluster_ranks,
    )
    runner.board.update(
        codec_forward=spec.codec_forward, codec_backward=spec.codec_backward, codec_choice=spec.codec_choice
    )
    cpu_exceeded = threading.Event()
    cpu_message = (
        f"the stage used its CPU time limit ({config['limits'].get('cpu_seconds')} s, "
        "NEBULA_TRAINER_STAGE_CPU_SECONDS)"
    )

    def forward(status: trainer_pb2.StageStatus) -> None:
        if cpu_exceeded.is_set() and status.state == trainer_pb2.STAGE_STATE_CANCELLED:
            ended = trainer_pb2.StageStatus()  # the cancel was the limit's, not the owner's
            ended.CopyFrom(status)
            status = ended
            status.state, status.message = trainer_pb2.STAGE_STATE_FAILED, cpu_message
        send(channel.STATUS, status.SerializeToString())

    runner.board.subscribe(forward)

    def on_cpu_limit(signum: int, frame: object) -> None:
        cpu_exceeded.set()
        runner.cancel()

    signal.signal(signal.SIGXCPU, on_cpu_limit)

    def listen() -> None:
        while True:
            try:
                kind, payload = channel.receive(conn)
            except (EOFError, channel.ChannelError):
                if asker is not None:
                    asker.answer(None)
                runner.cancel()  # the trainer is gone: nobody may keep training in its name
                return
            if kind == channel.CANCEL:
                runner.cancel()
            elif kind == channel.EPOCH_OK:
                epoch_ok.set()
            elif kind == channel.RANKS_REPLY and asker is not None:
                asker.answer(channel.parse_json(payload))

    escaped: list[BaseException] = []

    def on_escape(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None and args.thread is not None and args.thread.name.startswith("stage"):
            escaped.append(args.exc_value)

    threading.excepthook = on_escape
    threading.Thread(target=listen, name="channel", daemon=True).start()
    runner.start()
    runner.join()
    # A failed stage's edge sends its error close on a thread of its own (``EdgeSession.fail``): let
    # it reach the trainer before the process ends, so the other cluster hears the reason.
    deadline = time.monotonic() + 1.5  # within the trainer's ENDED_GRACE_S
    for thread in threading.enumerate():
        if thread.name.endswith("-abort"):
            thread.join(max(0.0, deadline - time.monotonic()))
    if not runner.board.finished:  # the stage's own thread broke down (no thread, no memory left)
        why = "; ".join(_chain(exc) for exc in escaped) or "the stage's thread ended without a status"
        runner.board.update(state=trainer_pb2.STAGE_STATE_FAILED, message=why)
    logging.shutdown()
    return 0


def _cluster_ranks(
    config: dict[str, Any], spec: Any, send: Callable[[bytes, bytes], None]
) -> tuple[Any, Any]:
    """The cluster's ranks as this stage's driver gets them through its trainer (``boxed_ranks``), and
    the asker the channel's reader hands the trainer's answers to; (None, None) off the ranks."""
    ranks = config.get("ranks")
    if not ranks:
        return None, None
    import datetime
    import json

    from services.trainer import stage_channel as channel
    from services.trainer.runtime.boxed_ranks import BoxedRanks, RanksAsker
    from services.trainer.runtime.store_bridge import BridgedStore

    asker = RanksAsker(lambda body: send(channel.RANKS, json.dumps(body).encode()))
    store_fd, clone_fd = (int(fd) for fd in ranks["fds"])
    store = BridgedStore(Connection(store_fd), Connection(clone_fd))
    store.set_timeout(datetime.timedelta(seconds=float(ranks["timeout"])))
    return asker, BoxedRanks(asker, int(ranks["world"]), store, spec)


def _chain(exc: BaseException) -> str:
    """An exception and what it was handling (a thread that could not start, under the failed fork)."""
    said = f"{type(exc).__name__}: {exc}"
    if exc.__context__ is not None:
        said += f" (while handling {type(exc.__context__).__name__}: {exc.__context__})"
    return said


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the job's own threads (a stuck one included) end with the process
