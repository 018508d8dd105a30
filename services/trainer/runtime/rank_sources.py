"""Where a stage's rank processes come from: spawned by the trainer, or started on their own.

``SpawnedRanks``: the trainer spawns n processes for one stage on its own host (a sharded stage
of a trainer without cluster ranks). They join a private TCPStore on 127.0.0.1 and exit with it.

``ClusterRanks``: n rank processes started the standard way, outside the trainer (``torchrun``
or a process manager running ``python -m services.trainer.worker``; two containers in compose; a StatefulSet
in Kubernetes), on any hosts of the cluster. They form their own default group once (c10d
rendezvous: ``MASTER_ADDR``/``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``) and join the trainer's rank
store (``NEBULA_TRAINER_RANKS_LISTEN``, behind mutual TLS: ``rank_gate``; the worker's
``NEBULA_WORKER_TRAINER``), where the trainer
posts each stage that runs on them (``stage/<n>/spec``); every stage gets a fresh command group
under ``stage/<n>/``. They run one stage at a time; a second stage that asks for them while
they are busy fails at once, saying so, rather than queueing behind a job that may run for days.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from nebula_common.ports import service_port
from services.trainer.runtime.parallel import HOST
from services.trainer.runtime.rank_gate import RankGate, RankTls, sign_spec
from services.trainer.runtime.rank_main import spawned_rank_main
from services.trainer.runtime.replica_compute import DataParallelError

JOIN_TIMEOUT_S = 300.0
"""How long a stage waits for the cluster's ranks to join (a worker starting: torch import, rendezvous)."""
WHY_WAIT_S = 2.0
"""How long a failed stage watches the ranks' heartbeats (``worker.HEARTBEAT_S``) to tell the dead."""
LOST_AFTER_S = 10.0
"""A rank whose heartbeat (every ``worker.HEARTBEAT_S``) stood still this long while it runs a stage is
lost (``lost/<rank>``): long enough that a loaded host's late beats never fail a healthy stage."""
WATCH_S = 0.5
"""How often the trainer reads the heartbeats of the ranks running a stage."""


class SpawnedRanks:
    """n rank processes of one stage, spawned by the trainer (see the module doc)."""

    def __init__(
        self, spec_bytes: bytes, world: int, data_dir: str, owner: str, timeout: float = 300.0
    ) -> None:
        self.world = world
        span = datetime.timedelta(seconds=timeout)
        self.store = dist.TCPStore(HOST, 0, world + 1, is_master=True, timeout=span, wait_for_workers=False)
        threads = max(1, (os.cpu_count() or 1) // world)
        context = mp.get_context("spawn")
        self._processes = [
            context.Process(
                target=spawned_rank_main,
                args=(spec_bytes, rank, world, self.store.port, data_dir, owner, threads, timeout),
                name=f"nebula-rank-{rank}",
                daemon=True,
            )
            for rank in range(world)
        ]
        for process in self._processes:
            process.start()

    def why(self, exc: BaseException) -> str:
        for process in self._processes:
            process.join(2)  # a rank that failed is exiting; its own reason is in the store
        said = []
        for rank, process in enumerate(self._processes):
            if self.store.check([f"error/{rank}"]):
                said.append(f"rank {rank} failed: {self.store.get(f'error/{rank}').decode(errors='replace')}")
            elif process.exitcode is not None:
                said.append(f"rank {rank} exited with code {process.exitcode}")
        return "; ".join(said) if said else str(exc)

    def finish(self, timeout: float) -> None:
        for process in self._processes:
            process.join(timeout)

    def abort(self) -> None:
        """End every rank process now (our own children, by handle); safe to repeat."""
        for process in self._processes:
            if process.is_alive():
                process.terminate()
        for process in self._processes:
            process.join(10)


class ClusterRanks:
    """The trainer's side of rank processes started on their own (see the module doc).

    ``listen`` is ``host:port`` of the rank store this trainer hosts; ``world`` how many ranks
    it waits for. The workers may come and go (a restarted worker joins again); a stage uses
    the ranks that are joined when it starts.
    """

    def __init__(
        self, listen: str, world: int, timeout: float = 300.0, *, tls: RankTls | None = None
    ) -> None:
        host, _, port = listen.rpartition(":")
        self.world = world
        self.timeout = timeout
        self.tls = tls
        span = datetime.timedelta(seconds=timeout)
        # With TLS (always, but for the plaintext development flag) the store itself is on loopback
        # and ``listen`` is its gate (``rank_gate``): only this cluster's workers get through.
        # On a port outside the ephemeral range: a rank's box connects only inside it (``rank_box``).
        self.store = _store(("127.0.0.1", 0) if tls is not None else (host, int(port)), world, span)
        self.gate = RankGate(listen, self.store.port, tls) if tls is not None else None
        self.port = self.gate.port if self.gate is not None else self.store.port
        self._busy = threading.Lock()

    def close(self) -> None:
        """Stop admitting workers (the store itself ends with the trainer's process)."""
        if self.gate is not None:
            self.gate.close()

    def joined(self) -> list[dict[str, object]]:
        """The workers that joined (``worker/<rank>``: host, pid, generation), by rank."""
        found = []
        for rank in range(self.world):
            key = f"worker/{rank}"
            if self.store.check([key]):
                found.append(json.loads(self.store.get(key)))
        return found

    def attach(self, spec_bytes: bytes, owner: str) -> AttachedRanks:
        """Post a stage to the ranks; its handle. Fails at once if another stage holds them."""
        if not self._busy.acquire(blocking=False):
            raise DataParallelError(
                "this cluster's ranks are running another stage; a stage across processes runs one at a time"
            )
        try:
            deadline = time.monotonic() + JOIN_TIMEOUT_S
            while len(self.joined()) < self.world:
                if time.monotonic() > deadline:
                    raise DataParallelError(
                        f"{len(self.joined())} of {self.world} cluster ranks joined the trainer's rank store "
                        f"(port {self.port}) within {JOIN_TIMEOUT_S:.0f} s; start the workers "
                        "(python -m services.trainer.worker, NEBULA_WORKER_TRAINER)"
                    )
                time.sleep(0.1)
            number = self.store.add("stage/posted", 1) - 1
            stage = dist.PrefixStore(f"stage/{number}", self.store)  # keys "stage/<n>/<key>"
            stage.set("owner", owner)
            if self.tls is not None:  # the workers run only what this trainer signed (rank_gate)
                signature, signer = sign_spec(self.tls.files, number, owner, spec_bytes)
                stage.set("signature", signature)
                stage.set("signer", signer)
            stage.set("spec", spec_bytes)  # last: the ranks start on this key
        except BaseException:
            self._busy.release()
            raise
        return AttachedRanks(self, stage)

    def release(self) -> None:
        self._busy.release()


def _store(address: tuple[str, int], world: int, span: datetime.timedelta) -> dist.TCPStore:
    """The rank store's master on ``address``; port 0 takes one outside the ephemeral range (a few
    tries: another program may take a port between its choice and the bind)."""
    host, port = address
    for attempt in range(5):
        try:
            return dist.TCPStore(
                host, port or service_port(), world + 1, is_master=True, timeout=span, wait_for_workers=False
            )
        except (RuntimeError, OSError):  # torch's DistNetworkError for a port in use
            if port or attempt == 4:
                raise
    raise AssertionError("unreachable")


class HeartbeatWatch:
    """Which ranks are lost, from their heartbeat counters read every ``WATCH_S``.

    A rank is lost when its counter stood still for ``LOST_AFTER_S`` while this watch ran on time and,
    with other ranks, while another's moved: a trainer too busy to read the beats, or a rank store
    that stalls for everyone, is not a rank that died.
    """

    def __init__(self, counts: list[int], now: float) -> None:
        self._last = [(count, now) for count in counts]  # each rank's counter, and when it last moved
        self._read = now
        self._lost: set[int] = set()

    def observe(self, counts: list[int], now: float) -> list[tuple[int, float]]:
        """The ranks newly lost at this reading, with how long each stood still."""
        if now - self._read > 4 * WATCH_S:  # this watch was late: the beats may be as late as it was
            self._last = [(count, now) for count, _ in self._last]
        self._read = now
        for rank, count in enumerate(counts):
            if count != self._last[rank][0]:
                self._last[rank] = (count, now)
        found = []
        for rank, (_, moved) in enumerate(self._last):
            if rank in self._lost or now - moved < LOST_AFTER_S:
                continue
            others = [at for r, (_, at) in enumerate(self._last) if r != rank and r not in self._lost]
            if others and max(others) - moved < LOST_AFTER_S / 2:
                continue  # no other rank beat since long after this one stopped: the store, not the rank
            self._lost.add(rank)
            found.append((rank, now - moved))
        return found


class AttachedRanks:
    """Cluster ranks while they run one stage."""

    def __init__(self, cluster: ClusterRanks, store: dist.Store) -> None:
        self._cluster = cluster
        self.world = cluster.world
        self.store = store
        self._released = False
        self._finished = False
        self._ended = threading.Event()
        # A client of its own: the driver's collectives and gets hold the shared one's lock.
        beats, marks = cluster.store.clone(), store.clone()
        threading.Thread(target=self._watch, args=(beats, marks), name="rank-heartbeats", daemon=True).start()

    def _watch(self, beats: dist.Store, marks: dist.Store) -> None:
        """Mark a lost rank (``HeartbeatWatch``) as ``lost/<rank>`` in the stage's keys, where its driver
        looks while a collective waits (``RankGroup``): a rank whose host stopped closes no socket, and
        its peers would otherwise wait out the whole collective timeout."""
        try:
            watch = HeartbeatWatch([beats.add(f"beats/{r}", 0) for r in range(self.world)], time.monotonic())
            while not self._ended.wait(WATCH_S):
                counts = [beats.add(f"beats/{rank}", 0) for rank in range(self.world)]
                for rank, still in watch.observe(counts, time.monotonic()):
                    marks.set(f"lost/{rank}", f"no heartbeat for {still:.0f} s")
        except (RuntimeError, OSError):  # the store is closing with the trainer
            return

    def why(self, exc: BaseException) -> str:
        """Which ranks died (their heartbeat stopped) and what the others said."""
        before = [self._cluster.store.add(f"beats/{rank}", 0) for rank in range(self.world)]
        time.sleep(WHY_WAIT_S)  # several heartbeats of a live rank
        after = [self._cluster.store.add(f"beats/{rank}", 0) for rank in range(self.world)]
        # A rank that said why it stopped is not "dead" (it exits after saying so; its beats stop too).
        dead = [str(r) for r in range(self.world) if after[r] == before[r] and not self._said(r)]
        said = [f"rank(s) {', '.join(dead)} died (no heartbeat for {WHY_WAIT_S:.0f} s)"] if dead else []
        said += [
            f"rank {rank} failed: {self.store.get(f'error/{rank}').decode(errors='replace')}"
            for rank in range(self.world)
            if self._said(rank)
        ]
        return "; ".join(said) if said else f"a rank's connection failed: {exc}"

    def _said(self, rank: int) -> bool:
        return bool(self.store.check([f"error/{rank}"]))

    def finish(self, timeout: float) -> None:
        """The ranks mark each stage done (``done/<rank>``) before they wait for the next one."""
        deadline = time.monotonic() + timeout
        while not all(self.store.check([f"done/{rank}"]) for rank in range(self.world)):
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        self._finished = True
        self._ended.set()
        self.store.set("finished", "1")  # a worker that (re)joins later does not take this stage

    def abort(self) -> None:
        """Free the ranks for the next stage. Ranks still inside this one (it failed or was cancelled)
        see ``aborted`` and exit, and their process manager starts them again."""
        self._ended.set()
        if not self._released:
            self._released = True
            if not self._finished:
                self.store.set("aborted", "1")
            self._cluster.release()


__all__ = ["AttachedRanks", "ClusterRanks", "HeartbeatWatch", "SpawnedRanks"]
