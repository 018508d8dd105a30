"""A stage's driver reaches the cluster's ranks only through its trainer (``stage_ranks``, ``boxed_ranks``).

Two workers join a real rank store behind its mutual-TLS gate, as in ``test_runtime_cluster_ranks``.
The driver side is what a stage process runs (``BoxedRanks`` over a real stage channel and the store
bridge's two socketpairs); the trainer side is ``StageRanks``, fed by the same channel as a stage
process's supervision feeds it. The stage trains exactly like one process with the combined batch; a
box that asks for more than its stage (another spec, a write of the keys the trainer posts, the global
keys, an operation of no protocol, more requests than it may have waiting) gets nothing; and the ranks
a box held are freed when its process is gone, for the next stage.
"""

from __future__ import annotations

import json
import socket
import threading
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch.distributed as dist

from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer import stage_channel as channel
from services.trainer.edge.memory import MemoryLink
from services.trainer.runtime.boxed_ranks import BoxedRanks, RanksAsker
from services.trainer.runtime.rank_sources import ClusterRanks
from services.trainer.runtime.replica_compute import DataParallelError
from services.trainer.runtime.store_bridge import BridgedStore
from services.trainer.stage_ranks import StageRanks
from tests.support.edges import StageRun, finish, stage_runner, wait_for
from tests.unit.test_runtime_cluster_ranks import Workers, cluster
from tests.unit.test_runtime_sharded_stage import SETTINGS, reference, same_training, small

pytestmark = [pytest.mark.ranks, pytest.mark.timeout(600)]
__all__ = ["cluster", "reference"]  # fixtures


class Channel:
    """A stage channel as a stage process and its trainer use it for the ranks: the trainer's reader
    hands ``RANKS`` to ``StageRanks``, the box's reader hands ``RANKS_REPLY`` to its asker."""

    def __init__(self, ranks: ClusterRanks, spec: trainer_pb2.StageSpec) -> None:
        ours, theirs = socket.socketpair()
        self.trainer_end, self.box_end = Connection(ours.detach()), Connection(theirs.detach())
        self._lock = threading.Lock()
        self.broken: list[str] = []
        self.trainer = StageRanks(ranks, spec, "tester", self._reply)
        self.asker = RanksAsker(lambda body: channel.send_json(self.box_end, channel.RANKS, body))
        ends = [Connection(end.detach()) for end in self.trainer.box_ends]
        self.store = BridgedStore(*ends)
        self.boxed = BoxedRanks(self.asker, ranks.world, self.store, spec)
        threading.Thread(target=self._trainer_reads, daemon=True).start()
        threading.Thread(target=self._box_reads, daemon=True).start()

    def _reply(self, body: dict[str, object]) -> None:
        with self._lock:
            channel.send_json(self.trainer_end, channel.RANKS_REPLY, body)

    def _trainer_reads(self) -> None:
        try:
            while True:
                kind, payload = channel.receive(self.trainer_end)
                if kind != channel.RANKS:
                    raise ValueError(f"unknown message kind {kind!r}")
                self.trainer.handle(channel.parse_json(payload))
        except (EOFError, OSError, channel.ChannelError):
            pass
        except ValueError as exc:  # the supervision ends such a stage: "it broke the protocol"
            self.broken.append(str(exc))
        finally:
            self.trainer.close()

    def _box_reads(self) -> None:
        try:
            while True:
                kind, payload = channel.receive(self.box_end)
                assert kind == channel.RANKS_REPLY, kind
                self.asker.answer(channel.parse_json(payload))
        except (EOFError, OSError, channel.ChannelError):
            self.asker.answer(None)

    def close(self) -> None:
        """The stage process is gone (its end of the channel closes)."""
        self.box_end.close()


def boxed_stage(job: object, work: Path, ranks: ClusterRanks) -> tuple[StageRun, StageRun, Channel]:
    link = MemoryLink()
    runs = [stage_runner(job, i, work, link, SETTINGS) for i in (0, 1)]  # type: ignore[arg-type]
    pipe = Channel(ranks, runs[1].runner.spec)
    runs[1].runner.cluster_ranks = pipe.boxed  # the loss-owning stage's driver, as in its box
    for run in runs:
        run.runner.start()
    return runs[0], runs[1], pipe


def test_a_driver_through_its_trainer_trains_like_one_process_and_frees_the_ranks(
    cluster: tuple[Workers, Path], reference: tuple[StageRun, StageRun]
) -> None:
    workers, work = cluster
    up, down, pipe = boxed_stage(small("boxed-driver"), work, workers.ranks)
    for run in (up, down):
        finish(run, 120)
    same_training((up, down), reference)
    assert down.runner.board.latest().state == trainer_pb2.STAGE_STATE_SUCCEEDED
    pipe.close()
    # Freed: the next stage gets the ranks at once (a held lock fails it at once, saying so).
    up, down, pipe = boxed_stage(small("boxed-driver-2"), work, workers.ranks)
    for run in (up, down):
        finish(run, 120)
    same_training((up, down), reference)
    pipe.close()
    assert all(process.poll() is None for process in workers.processes)


def test_a_box_gets_only_its_own_stage_and_its_ranks_are_freed_when_it_is_gone(
    cluster: tuple[Workers, Path],
) -> None:
    workers, _ = cluster
    ranks = workers.ranks
    spec = trainer_pb2.StageSpec(
        job_id="hostile-driver", stage="decoder", steps=2, program=trainer_pb2.ProgramStage(role="downstream")
    )
    pipe = Channel(ranks, spec)
    with pytest.raises(RuntimeError, match="no stage is bridged yet"):
        pipe.store.check(["spec"])  # nothing before it asked for its ranks
    # An attach that names a spec and an owner of its own: the trainer posts its copy, for its owner.
    forged = {"op": "attach", "resume_step": None, "spec": "import os", "owner": "mallory"}
    assert pipe.asker.ask(forged, 60)["world"] == 2
    number = int(ranks.store.add("stage/posted", 0)) - 1
    posted = dist.PrefixStore(f"stage/{number}", ranks.store)
    assert trainer_pb2.StageSpec.FromString(posted.get("spec")) == spec
    assert posted.get("owner") == b"tester"
    store = pipe.store  # now that stage's keys
    for key in ("spec", "owner", "signature", "signer", "finished"):
        with pytest.raises(RuntimeError, match="the trainer's to write"):
            store.set(key, b"x")
    assert trainer_pb2.StageSpec.FromString(posted.get("spec")) == spec
    store.set("error/9", b"its own keys are its own")
    assert posted.get("error/9") == b"its own keys are its own"
    assert not store.check(["worker/0"]) and not store.check(["stage/posted"])
    with pytest.raises(DataParallelError, match="resume_step must be"):
        pipe.asker.ask({"op": "attach", "resume_step": "1; drop"}, 30)
    assert posted.check(["aborted"])  # that attach released the attempt before it (a re-attempt's way)
    wait_for(lambda: not ranks._busy.locked(), 30, "the refused attach to leave the ranks free")
    pipe.boxed.attach(spec.SerializeToString(), "tester")
    assert ranks._busy.locked()
    pipe.box_end.send_bytes(channel.RANKS + json.dumps({"op": "post", "spec": "x"}).encode())
    wait_for(lambda: pipe.broken, 30, "the trainer side to refuse an operation of no protocol")
    assert "not a ranks operation" in pipe.broken[0]
    # Its process is gone (the supervision closes its ranks): they are free for the next stage.
    wait_for(lambda: not ranks._busy.locked(), 30, "the ranks to be freed when the box is gone")
    last = int(ranks.store.add("stage/posted", 0)) - 1
    assert ranks.store.check([f"stage/{last}/aborted"])
    pipe.close()
    wait_for(
        lambda: all(process.poll() is not None for process in workers.processes),
        60,
        "the ranks inside the aborted stages to leave them (their process manager starts them again)",
    )


def test_a_box_that_floods_its_trainer_with_requests_breaks_the_protocol() -> None:
    ranks = ClusterRanks("127.0.0.1:0", world=2)  # no worker joined: an attach waits on the ranks' thread
    spec = trainer_pb2.StageSpec(job_id="flood", stage="decoder", program=trainer_pb2.ProgramStage())
    answers: list[dict[str, object]] = []
    trainer = StageRanks(ranks, spec, "tester", answers.append)
    try:
        with pytest.raises(ValueError, match="more than 8 requests for the ranks unanswered"):
            for _ in range(100):
                trainer.handle({"op": "attach", "resume_step": None})
        for rank in range(ranks.world):  # the waiting attach gets its ranks: then it frees them, closed
            ranks.store.set(f"worker/{rank}", json.dumps({"rank": rank, "host": "h"}))
    finally:
        trainer.close()
    wait_for(lambda: not ranks._busy.locked(), 30, "the attach that was waiting to free the ranks it got")
    assert not answers  # nothing is answered to a box that is gone
    ranks.close()
