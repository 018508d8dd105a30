"""A stage whose compute runs on rank processes: the trainer's stage thread drives them.

Two cases use it. A sharded stage (``parallel: fsdp | hsdp``): FSDP2, DeviceMesh and DCP work on
torch.distributed's *default* process group, which a trainer running other jobs' stages must not
claim, so the trainer spawns every compute rank as a process of its own (``SpawnedRanks``). And a
stage across processes started the standard way (torchrun, compose, a StatefulSet: the ranks of
``services/trainer/worker.py``, ``ClusterRanks``), whatever its ``parallel``. The ranks form two
groups:

* the compute group: torch.distributed's default group of the rank processes (world n, gloo on
  CPU, NCCL on CUDA), over which DDP all-reduces, FSDP all-gathers and reduce-scatters, and DCP
  saves and loads;
* the command group: a private gloo group of n + 1 (``parallel.make_process_group``), the stage
  thread as rank 0 (the driver, which alone holds the WAN edge) and compute rank r as r + 1. Only
  the driver talks to the switch; the ranks talk only to each other and to the driver.

For each micro-batch the driver broadcasts the received tensor, every rank computes its rows, and
the driver gathers the rows' gradients (its own slot is a placeholder); the loss is all-reduced.
Upstream, the driver gathers the ranks' output rows into the activation it sends, and broadcasts
the gradient that comes back. A chain's middle (the driver holds both of its edges): the driver
broadcasts what came from above and gathers the ranks' output rows, then broadcasts the gradient from
below and gathers the gradient rows of what the ranks received. At a step boundary the ranks step
their optimizers (each its shard); at a checkpoint they write DCP shards into the store's temporary
directory and the driver publishes it (``CheckpointStore.save_sharded``). The driver's own copy of
the model is not trained; after the last step it is loaded from the final checkpoint (evaluation
and callers read it).

A rank that fails leaves its reason in the command store (``error/<rank>``); one that dies breaks
the next collective at once (its sockets close). Either way the stage fails with a message naming
the ranks and what they said.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from nebula_common.jobspec.runtime import StageProgram
from services.trainer.runtime.checkpoint import CheckpointStore
from services.trainer.runtime.parallel import (
    _HEADER,
    CMD_BACKWARD,
    CMD_FORWARD,
    CMD_MICRO_BATCH,
    CMD_STEP,
    CMD_STOP,
    _gather_options,
    make_process_group,
)
from services.trainer.runtime.rank_main import (
    CMD_MIDDLE_BACKWARD,
    CMD_MIDDLE_FORWARD,
    CMD_SAVE,
    empty_like_header,
    header,
)
from services.trainer.runtime.replica_compute import DataParallelError

JOIN_POLL_S = 0.2
"""How often the driver looks for a rank's failure while the command group forms."""
WATCH_S = 1.0
"""How often the driver looks for a failed or lost rank while a collective waits."""

log = logging.getLogger(__name__)


class Ranks(Protocol):
    """The rank processes of one stage, as the driver sees them (see ``rank_sources``)."""

    world: int
    store: dist.Store  # this stage's command store (its keys are this stage's alone)

    def why(self, exc: BaseException) -> str:
        """What the ranks said (or that they died) when a collective failed with ``exc``."""
        ...

    def finish(self, timeout: float) -> None:
        """After CMD_STOP: wait for the ranks to be done with this stage."""
        ...

    def abort(self) -> None:
        """The stage is over, however it ended: no rank may keep working on it."""
        ...


class RankSource(Protocol):
    """Where a stage's driver gets the cluster's ranks: ``ClusterRanks`` in the trainer (tests), or
    ``BoxedRanks`` in a stage process, through its trainer."""

    world: int

    def attach(self, spec_bytes: bytes, owner: str) -> Ranks:
        """The ranks, running this attempt of the stage."""
        ...

    def joined(self) -> list[dict[str, object]]:
        """The workers that joined (at least their ``host``)."""
        ...


class RankGroup:
    """The driver of a stage whose compute runs on rank processes (see the module doc).

    The same interface as ``DataParallelGroup``, plus ``save_checkpoint``.
    """

    def __init__(
        self,
        ranks: Ranks,
        program: StageProgram,
        *,
        micro_batches: int,
        backprop: bool,
        store: CheckpointStore,
        owner: str,
        upstream: bool = False,
        middle: bool = False,
        timeout: float = 300.0,
    ) -> None:
        if (upstream or middle) and not backprop:
            raise ValueError("a one_way upstream stage runs on one process (and a chain trains backprop)")
        self._ranks = ranks
        self.ranks = ranks.world
        self.program = program
        self.micro_batches = micro_batches
        self.backprop = backprop
        self.upstream = upstream
        self.middle = middle
        self.checkpoints = store
        self.parameter_bytes: list[int] = []
        """Bytes of parameters each rank holds (its shards only on a sharded stage), rank order."""
        self.owner = owner
        self._stopped = False
        self._shapes: dict[int, torch.Size] = {}
        # A middle's micro-batches in flight: shape and dtype of a rank's received rows, output shape.
        self._relayed: dict[int, tuple[torch.Size, torch.dtype, torch.Size]] = {}
        try:
            self.group = self._join_commands(timeout)
            self._ready()
            self.parameter_bytes = [int(ranks.store.get(f"parameter_bytes/{r}")) for r in range(self.ranks)]
        except Exception as exc:
            why = ranks.why(exc)
            self.abort()
            raise DataParallelError(f"the stage's ranks did not start: {why}") from exc

    def _join_commands(self, timeout: float) -> dist.ProcessGroup:
        """The command group, formed on a thread while this one watches for a rank that said it failed
        (``error/<rank>``, e.g. a rank's box that could not start): gloo's own wait for a rank that
        never comes is the whole timeout."""
        formed: dict[str, Any] = {}
        # A client of its own: gloo's blocking gets would hold the shared client's lock against the checks.
        joining_store = self._ranks.store.clone()

        def join() -> None:
            try:
                cmd = dist.PrefixStore("cmd/", joining_store)
                formed["group"] = make_process_group(cmd, 0, self.ranks + 1, timeout)
            except BaseException as exc:  # handed to the watching thread
                formed["error"] = exc

        joining = threading.Thread(target=join, name="rank-commands-join", daemon=True)
        joining.start()
        while joining.is_alive():
            joining.join(JOIN_POLL_S)
            if joining.is_alive() and self._gone():
                raise DataParallelError("a rank failed before it joined the stage's command group")
        if "error" in formed:
            raise formed["error"]
        return formed["group"]

    def _collective(self, work: Any) -> None:
        try:
            self._wait(work)
        except Exception as exc:
            self._abort_group()  # ranks still waiting on the driver fail now, and say why
            raise DataParallelError(f"a rank of the stage failed: {self._ranks.why(exc)}") from exc

    def _wait(self, work: Any) -> None:
        """Wait for a collective, looking every ``WATCH_S`` for a rank that failed (``error/<rank>``) or
        that its trainer found lost (``lost/<rank>``, ``rank_sources``): gloo learns of a dead peer only
        from its sockets, and the collective's own timeout is the whole stage's patience."""
        done = threading.Event()
        work.get_future().add_done_callback(lambda _: done.set())
        while not done.wait(WATCH_S):
            if gone := self._gone():
                raise DataParallelError(f"rank(s) {', '.join(map(str, gone))} left the stage's collective")
        work.wait()  # its result: raises if it failed

    def _gone(self) -> list[int]:
        """The ranks that said they failed or were found lost."""
        store = self._ranks.store
        return [r for r in range(self.ranks) if store.check([f"error/{r}"]) or store.check([f"lost/{r}"])]

    def _abort_group(self) -> None:
        group = getattr(self, "group", None)
        if group is not None:
            with contextlib.suppress(Exception):  # already broken is fine
                group.abort()

    def _ready(self) -> None:
        """Every rank built, sharded and loaded its stage (a rank that failed to has said why)."""
        count = torch.zeros(1)
        self._collective(self.group.allreduce([count]))
        if int(count.item()) != self.ranks:
            raise DataParallelError(f"{int(count.item())} of {self.ranks} ranks ready")

    def _send(self, cmd: int, step: int, micro_batch: int = 0, tensor: torch.Tensor | None = None) -> None:
        self._collective(self.group.broadcast(header(cmd, step, micro_batch, tensor), 0))
        if tensor is not None:
            self._collective(self.group.broadcast(tensor, 0))

    def _gather(self, like: torch.Tensor) -> list[torch.Tensor]:
        """The ranks' tensors of ``like``'s shape, in rank order (the driver's slot is a placeholder)."""
        parts = [torch.empty_like(like) for _ in range(self.ranks + 1)]
        self._collective(self.group.gather([parts], [like], _gather_options()))
        return parts[1:]

    def _mean_loss(self) -> float:
        loss = torch.zeros(1)
        self._collective(self.group.allreduce([loss]))
        return float(loss.item()) / self.ranks

    def micro_batch(
        self, step: int, micro_batch: int, received: torch.Tensor, ids: list[int]
    ) -> tuple[float, torch.Tensor | None]:
        """Send a received micro-batch to the ranks; (mean loss, gradient of received)."""
        received = received.detach().contiguous()
        self._send(CMD_MICRO_BATCH, step, micro_batch, received)
        gathered: torch.Tensor | None = None
        if self.backprop:
            like = received.chunk(self.ranks)[0].contiguous()
            # The combined loss is the mean of the ranks' losses: each rank's rows get 1/n of its gradient.
            gathered = torch.cat(self._gather(like)) / self.ranks
        return self._mean_loss(), gathered

    def forward(self, step: int, micro_batch: int, ids: list[int]) -> torch.Tensor:
        """Upstream: every rank runs its rows of the micro-batch; the gathered activation to send."""
        self._send(CMD_FORWARD, step, micro_batch)
        shape = torch.zeros(_HEADER, dtype=torch.int64)
        self._collective(self.group.broadcast(shape, 1))  # rank 0's output rows: shape and dtype
        out = torch.cat(self._gather(empty_like_header(shape)))
        self._shapes[micro_batch] = out.shape
        return out

    def backward(self, step: int, micro_batch: int, grad: torch.Tensor) -> None:
        """Upstream: send the received gradient; each rank backpropagates the rows it produced."""
        shape = self._shapes.pop(micro_batch)
        if grad.shape != shape:
            raise DataParallelError(f"gradient shape {tuple(grad.shape)} != activation {tuple(shape)}")
        self._send(CMD_BACKWARD, step, micro_batch, grad.detach().contiguous())

    def relay(self, step: int, micro_batch: int, received: torch.Tensor, ids: list[int]) -> torch.Tensor:
        """Middle: every rank relays its rows of what came from above; the gathered output to send below."""
        received = received.detach().contiguous()
        self._send(CMD_MIDDLE_FORWARD, step, micro_batch, received)
        shape = torch.zeros(_HEADER, dtype=torch.int64)
        self._collective(self.group.broadcast(shape, 1))  # rank 0's output rows: shape and dtype
        out = torch.cat(self._gather(empty_like_header(shape)))
        rows = received.chunk(self.ranks)[0]
        self._relayed[micro_batch] = (rows.shape, rows.dtype, out.shape)
        return out

    def relay_backward(self, step: int, micro_batch: int, grad: torch.Tensor) -> torch.Tensor:
        """Middle: every rank backpropagates its rows of the gradient from below; the gathered one goes up.

        Each rank's rows get exactly their part of that gradient (it is the combined loss's already),
        so the gathered gradient of what was received is not divided by the ranks.
        """
        rows, dtype, sent = self._relayed.pop(micro_batch)
        if grad.shape != sent:
            raise DataParallelError(f"gradient shape {tuple(grad.shape)} != activation {tuple(sent)}")
        self._send(CMD_MIDDLE_BACKWARD, step, micro_batch, grad.detach().contiguous())
        return torch.cat(self._gather(torch.empty(rows, dtype=dtype)))

    def finish_step(self, step: int) -> None:
        """Every rank steps its optimizer; a counter all-reduce confirms all are at ``step``."""
        self._send(CMD_STEP, step)
        done = torch.zeros(1)
        self._collective(self.group.allreduce([done]))
        if int(done.item()) != (step + 1) * self.ranks:
            raise DataParallelError(f"ranks out of step after step {step}: counter {done.item()}")

    def save_checkpoint(self, job_id: str, stage: str, step: int, *, final: bool) -> Path:
        """Every rank writes its part (DCP); published once all wrote. ``final``: load it here too."""

        def write(directory: Path) -> None:
            self._send(CMD_SAVE, step)
            written = torch.zeros(1)
            self._collective(self.group.allreduce([written]))
            if int(written.item()) != self.ranks:
                raise DataParallelError(
                    f"{int(written.item())} of {self.ranks} ranks wrote checkpoint {step}"
                )

        path = self.checkpoints.save_sharded(job_id, stage, self.owner, step, write)
        if final:  # the driver's model becomes the trained one (evaluation, callers)
            self.checkpoints.load(job_id, stage, step, self.owner, self.program)
        return path

    def stop(self) -> None:
        """Tell the ranks this stage is over and wait for them."""
        if self._stopped:
            return
        self._send(CMD_STOP, 0)
        self._ranks.finish(30)
        self.abort()

    def abort(self) -> None:
        """End the ranks' work on this stage now; safe to repeat."""
        if not self._stopped:
            self._stopped = True
            self._abort_group()
        self._ranks.abort()


__all__ = ["RankGroup", "Ranks"]
