"""``python -m services.trainer.worker``: one rank of a stage across processes.

Started the standard way, one process per rank, on any host of the cluster: ``torchrun`` (which
sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; c10d rendezvous), or a process
manager, compose service or StatefulSet that sets them. The ranks form their own default group
once (gloo on CPU, NCCL when CUDA is present); then each joins its cluster's trainer's rank store
(``NEBULA_WORKER_TRAINER=host:port``, the trainer's ``NEBULA_TRAINER_RANKS_LISTEN``) and runs the
stages the trainer posts there, one after the other, as each stage's driver (in its stage box on
the trainer) drives them (``runtime/rank_group.py``). Only the trainer's stage boxes talk to the
switch; a worker never leaves the cluster.

A stage's code never runs in the worker: each stage runs in a box of its own (``rank_box``: bubblewrap
where the host allows it, else Landlock, as ``NEBULA_WORKER_STAGE_ISOLATION`` asks, default ``auto``),
with its limits (``NEBULA_WORKER_STAGE_MEMORY_MB``, ``NEBULA_WORKER_STAGE_CPU_SECONDS``,
``NEBULA_WORKER_STAGE_OPEN_FILES``) and its stage's keys of the rank store only; the worker logs the
box at start-up, with a warning when it is weaker than bubblewrap's.

The rank store is reached through mutual TLS (``runtime/rank_gate.py``): ``NEBULA_WORKER_INTERNAL_TLS_DIR``
holds the worker's identity (``ca.crt``, ``service.crt``, ``service.key``; role ``worker`` of the
cluster: ``nebula pki issue-service --service worker``), and a worker runs only specs its cluster's
trainer signed.

``NEBULA_WORKER_DATA_DIR`` must be the trainer's data dir (the same host, or one shared volume):
the ranks write the stage's checkpoints there. A worker whose group broke (another rank died, or
the trainer went away) exits non-zero, and its process manager starts the ranks again.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from nebula_common.errors import NebulaError
from nebula_common.pki.service_identity import ServiceTlsFiles
from nebula_common.rpc.internal_tls import cluster_of_ca, plaintext_allowed
from services.trainer.rank_box import SETTING as RANK_BOX_SETTING
from services.trainer.rank_box import RankBoxes, adopt_orphans
from services.trainer.runtime.rank_gate import RankAuthError, RankTls, RankTunnel, verify_spec
from services.trainer.sandbox import MODES, SandboxError, StageLimits

log = logging.getLogger("nebula.trainer.worker")
POLL_S = 30.0
HEARTBEAT_S = 0.5


class WorkerConfigError(ValueError):
    """A missing or invalid setting; the message names it."""


def _env(name: str, default: str | None = None) -> str:
    value = os.environ.get(name, default)
    if value is None or value == "":
        raise WorkerConfigError(f"{name} is required")
    return value


def _int(name: str, default: str | None = None, low: int = 0) -> int:
    raw = _env(name, default)
    try:
        value = int(raw)
    except ValueError:
        raise WorkerConfigError(f"{name} must be an integer, got {raw!r}") from None
    if value < low:
        raise WorkerConfigError(f"{name} must be >= {low}, got {value}")
    return value


def settings() -> dict[str, object]:
    """The worker's settings from the environment (torchrun's variables and NEBULA_WORKER_*)."""
    rank, world = _int("RANK"), _int("WORLD_SIZE", low=1)
    if rank >= world:
        raise WorkerConfigError(f"RANK {rank} must be below WORLD_SIZE {world}")
    _env("MASTER_ADDR")
    _int("MASTER_PORT", low=1)
    trainer = _env("NEBULA_WORKER_TRAINER")
    host, _, port = trainer.rpartition(":")
    if not host or not port.isdigit():
        raise WorkerConfigError(f"NEBULA_WORKER_TRAINER must be host:port, got {trainer!r}")
    return {
        "rank": rank,
        "world": world,
        "trainer": trainer,
        "trainer_host": host,
        "trainer_port": int(port),
        "tls_dir": _tls_dir(),
        "data_dir": Path(_env("NEBULA_WORKER_DATA_DIR")),
        "threads": _int("NEBULA_WORKER_TORCH_THREADS", "1", low=1),
        "timeout": float(_int("NEBULA_WORKER_TIMEOUT_S", "300", low=1)),
        "isolation": _isolation(),
        "limits": StageLimits(
            memory_bytes=_int("NEBULA_WORKER_STAGE_MEMORY_MB", "8192", low=256) << 20,
            cpu_seconds=_int("NEBULA_WORKER_STAGE_CPU_SECONDS", str(30 * 24 * 3600), low=10),
            open_files=_int("NEBULA_WORKER_STAGE_OPEN_FILES", "4096", low=64),
        ),
    }


def _isolation() -> str:
    value = os.environ.get(RANK_BOX_SETTING, "auto") or "auto"
    if value not in MODES:
        raise WorkerConfigError(f"{RANK_BOX_SETTING} must be one of {', '.join(MODES)}, got {value!r}")
    return value


def _tls_dir() -> Path | None:
    """Where the worker's identity is (None only under the plaintext development flag)."""
    directory = os.environ.get("NEBULA_WORKER_INTERNAL_TLS_DIR", "")
    if not directory:
        if plaintext_allowed():
            return None
        raise WorkerConfigError(
            "NEBULA_WORKER_INTERNAL_TLS_DIR is required: the worker's ca.crt, service.crt and service.key "
            "(role worker of its cluster); the trainer's rank store accepts no one else"
        )
    return Path(directory)


def load_tls(directory: Path | None) -> RankTls | None:
    """The worker's identity from its directory, checked readable; the cluster is its CA's."""
    if directory is None:
        return None
    files = ServiceTlsFiles.in_dir(directory)
    try:
        ca_pem = files.ca.read_bytes()
        for path in (files.cert, files.key):
            path.read_bytes()
        cluster = cluster_of_ca(ca_pem, str(files.ca))
    except (OSError, NebulaError) as exc:
        raise WorkerConfigError(f"NEBULA_WORKER_INTERNAL_TLS_DIR={directory}: {exc}") from None
    return RankTls(files, cluster)


def serve(config: dict[str, object]) -> None:
    """Join the ranks' group and the trainer's rank store; run every stage posted there, each in a box."""
    from services.trainer.runtime.rank_main import join_compute_group, report_failure

    rank, world = int(config["rank"]), int(config["world"])  # type: ignore[call-overload]
    timeout = float(config["timeout"])  # type: ignore[arg-type]
    torch.set_num_threads(int(config["threads"]))  # type: ignore[call-overload]
    span = datetime.timedelta(seconds=timeout)
    # c10d rendezvous of the ranks, as torchrun's workers do (env://: MASTER_ADDR/PORT, RANK, WORLD_SIZE;
    # under torchrun, its agent's store).
    device = join_compute_group(None, rank, world, timeout)
    log.info(
        "rank %d of %d: %s group on %s (c10d rendezvous through %s)",
        rank,
        world,
        dist.get_backend(),
        device,
        "torchrun's agent store" if os.environ.get("TORCHELASTIC_RUN_ID") else "MASTER_ADDR/MASTER_PORT",
    )
    boxes = config["boxes"]
    assert isinstance(boxes, RankBoxes)
    tls = config.get("tls")
    if isinstance(tls, RankTls):  # the store's two clients (this one, the heartbeat's): then it closes
        tunnel = RankTunnel(str(config["trainer"]), tls, max_connections=2)
        config["trainer_host"], config["trainer_port"] = "127.0.0.1", tunnel.port
    trainer = dist.TCPStore(
        str(config["trainer_host"]),
        int(config["trainer_port"]),
        is_master=False,
        timeout=span,  # type: ignore[call-overload]
    )
    beats = dist.TCPStore(str(config["trainer_host"]), int(config["trainer_port"]), is_master=False)  # type: ignore[call-overload]
    number = _first_stage(trainer)
    identity = {
        "rank": rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "isolation": boxes.describe(),
    }
    trainer.set(f"worker/{rank}", json.dumps(identity))
    log.info("rank %d of %d joined the trainer's rank store", rank, world)
    current = [number]
    beat = threading.Thread(target=_heartbeat, args=(beats, rank, current), name="heartbeat", daemon=True)
    beat.start()
    while True:
        key = f"stage/{number}/spec"
        try:
            trainer.wait([key], datetime.timedelta(seconds=POLL_S))
        except dist.DistStoreError as exc:
            if "timeout" in str(exc).lower():
                continue  # no stage yet
            raise
        stage = dist.PrefixStore(f"stage/{number}", trainer)  # the key above is its "spec"
        owner, spec = stage.get("owner").decode(), stage.get("spec")
        if isinstance(tls, RankTls):
            try:
                verify_spec(
                    tls.files.ca.read_bytes(),
                    tls.cluster_id,
                    number,
                    owner,
                    spec,
                    stage.get("signature") if stage.check(["signature"]) else b"",
                    stage.get("signer") if stage.check(["signer"]) else b"",
                )
            except RankAuthError as exc:  # not the trainer's: never run it, say so, wait for the next
                log.error("rank %d: stage %d refused: %s", rank, number, exc)
                report_failure(stage, rank, exc)
                number += 1
                current[0] = number
                continue
        log.info("rank %d: stage %d posted; joining its command group", rank, number)
        try:
            boxes.run(spec, rank, world, stage, config["data_dir"], owner)  # type: ignore[arg-type]
        except Exception as exc:
            if not stage.check([f"error/{rank}"]):  # the box said why itself, unless it could not
                report_failure(stage, rank, exc)
            raise
        stage.set(f"done/{rank}", "1")
        number += 1
        current[0] = number


def _first_stage(trainer: dist.Store) -> int:
    """The stage this worker runs first: one posted but never started (the ranks were restarting when
    the trainer posted it, e.g. a resume right after a rank died) or else the next one. Stages that
    finished or were aborted are never joined again."""
    posted = trainer.add("stage/posted", 0)
    last = posted - 1
    ended = last < 0 or trainer.check([f"stage/{last}/finished"]) or trainer.check([f"stage/{last}/aborted"])
    return posted if ended else last


def _heartbeat(store: dist.Store, rank: int, current: list[int]) -> None:
    """Beat every HEARTBEAT_S (the trainer tells a dead rank from a live one by it), and leave at once
    when the trainer aborted the stage this rank runs: a rank blocked in a collective with a dead peer
    would otherwise wait out the whole collective timeout. Its process manager starts it again."""
    while True:
        try:
            store.add(f"beats/{rank}", 1)
            if store.check([f"stage/{current[0]}/aborted"]):
                log.error(
                    "rank %d: the trainer aborted stage %d; exiting so the ranks form again", rank, current[0]
                )
                os._exit(1)
        except Exception as exc:  # the trainer went away: this rank's stages are over
            log.error("rank %d: lost the trainer's rank store (%s); exiting", rank, exc)
            os._exit(1)
        time.sleep(HEARTBEAT_S)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = settings()
        config["tls"] = load_tls(config["tls_dir"])  # type: ignore[arg-type]
        config["boxes"] = boxes = RankBoxes.probe(
            str(config["isolation"]),
            config["limits"],  # type: ignore[arg-type]
            int(config["threads"]),  # type: ignore[call-overload]
            float(config["timeout"]),  # type: ignore[arg-type]
        )
    except (WorkerConfigError, SandboxError) as exc:
        print(f"nebula trainer worker: {exc}", file=sys.stderr)
        return 2
    adopt_orphans()
    if boxes.confinement.weaker_because:  # never silently weaker than bubblewrap
        log.warning(
            "rank %s: stages run in a weaker box than bubblewrap's (%s): %s",
            config["rank"],
            boxes.confinement.weaker_because,
            boxes.describe(),
        )
    else:
        log.info("rank %s: stages run boxed: %s", config["rank"], boxes.describe())
    try:
        serve(config)
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # the group broke: exit so the process manager starts the ranks again
        log.error("rank %s stopped: %s: %s", config["rank"], type(exc).__name__, exc)
        _leave(1)
    return 0


def _leave(code: int) -> NoReturn:
    """Exit now, without the interpreter's teardown: a rank whose group broke has nothing to clean up.

    A normal exit finalizes every module first (torch's are many: 11 s at load 22, 40 s at load 25
    seen in ``Py_FinalizeEx``) and waits for non-daemon threads, while the heartbeat thread, which
    would end the process once the trainer aborts the stage, is frozen by the finalization. The
    surviving rank of a stage whose peer died then took over 30 s to exit. The log is flushed first.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
