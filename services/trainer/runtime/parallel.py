"""Data parallelism of one stage inside its cluster: rank 0 (the trainer's stage thread) plus spawned ranks.

Why this shape: only rank 0 holds the job's edge to the switch (one stream per
edge, one place that checks the schedule), so ranks 1..n-1 never see the WAN.
For every micro-batch that arrives, rank 0 scatters its rows; each rank builds
the matching rows of its own data shard (same cluster, same example ids),
computes the loss through DDP (which averages parameter gradients across ranks
on the last micro-batch of a step), and in backprop mode rank 0 gathers the
gradients of the received rows to send back. At each step boundary every rank
steps its optimizer and the ranks all-reduce a counter, so the replicas have
synced before rank 0 syncs with the other cluster (the paper's Figure 6).

Rank 0 lives in the trainer process, which may run other jobs' stages at the
same time, so it must not claim torch.distributed's process-global default
group: each job builds its own gloo process group on a private TCPStore (the
same construction ``torch.distributed.new_group`` performs internally). The
other ranks are ``torch.multiprocessing`` spawn children of the trainer, on the
same host. Losses must be means over a batch's examples: with equal row chunks
the mean of the ranks' means is then the combined batch's mean, which is what
makes n ranks equal one rank with the combined batch.

An upstream stage (backprop mode) runs on n ranks too: for each forward rank 0
broadcasts the micro-batch, every rank runs its rows of it and rank 0 gathers
the output rows into the activation it sends; for each backward rank 0
scatters the received gradient rows back to the ranks that produced them. Its
parameter gradients are summed across ranks at the step boundary rather than
by DDP's reducer, because DDP starts syncing at the backward that follows the
last micro-batch's forward, and under 1F1B earlier micro-batches' backwards
still come after that forward.

A middle stage of a chain runs on n ranks the same way; rank 0 holds both of
its edges. For each micro-batch that arrives from above, rank 0 scatters its
rows, every rank relays its rows and rank 0 gathers the output rows into the
activation it sends below; for each gradient that comes from below, rank 0
scatters its rows, every rank backpropagates them and rank 0 gathers the
gradient rows of what it received into the one it sends above. Parameter
gradients are summed at the step boundary, as upstream.
"""

from __future__ import annotations

import datetime
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nebula_common.jobspec.runtime import StageProgram, example_ids
from services.trainer.runtime.replica_compute import (
    DTYPES,
    DataParallelError,
    MiddleCompute,
    ReplicaCompute,
    UpstreamCompute,
    sum_gradients,
)

log = logging.getLogger(__name__)
HOST = "127.0.0.1"
CMD_STOP, CMD_MICRO_BATCH, CMD_STEP, CMD_FORWARD, CMD_BACKWARD = 0, 1, 2, 3, 4
CMD_RELAY, CMD_RELAY_BACK = 5, 6  # a chain's middle stage: its rows forward, their gradient back
_HEADER = 16  # cmd, step, micro_batch, dtype index, ndim, up to 11 dims
_GLOO = dist.ProcessGroup.BackendType.GLOO


def make_process_group(store: dist.Store, rank: int, world: int, timeout: float) -> dist.ProcessGroup:
    """A gloo process group that is not the process-global default one (see the module docstring)."""
    span = datetime.timedelta(seconds=timeout)
    backend = dist.ProcessGroupGloo(store, rank, world, span)
    group = dist.ProcessGroup(store, rank, world)
    group._set_default_backend(_GLOO)
    group._register_backend(torch.device("cpu"), _GLOO, backend)
    return group


def _rows(ids: list[int], rank: int, world: int) -> list[int]:
    size = len(ids) // world
    return ids[rank * size : (rank + 1) * size]


def _scatter_options() -> dist.ScatterOptions:
    options = dist.ScatterOptions()
    options.rootRank = 0
    return options


def _gather_options() -> dist.GatherOptions:
    options = dist.GatherOptions()
    options.rootRank = 0
    return options


class DataParallelGroup:
    """Rank 0 of a data-parallel stage: starts ranks 1..n-1 and drives them micro-batch by micro-batch."""

    compute: ReplicaCompute  # downstream stages only
    up: UpstreamCompute  # upstream stages only
    mid: MiddleCompute  # a chain's middle stages only

    def __init__(
        self,
        spec_bytes: bytes,
        program: StageProgram,
        *,
        replicas: int,
        micro_batches: int,
        backprop: bool,
        data_dir: Path,
        owner: str,
        upstream: bool = False,
        middle: bool = False,
        timeout: float = 300.0,
    ) -> None:
        if replicas < 2:
            raise ValueError("a data-parallel group needs at least 2 replicas")
        self.replicas = replicas
        self.program = program
        self.micro_batches = micro_batches
        self.backprop = backprop
        self.upstream = upstream
        self.middle = middle
        if (upstream or middle) and not backprop:
            raise ValueError("a one_way upstream stage runs on one process (and a chain trains backprop)")
        self._stopped = False
        self._shapes: dict[int, torch.Size] = {}
        span = datetime.timedelta(seconds=timeout)
        self._store = dist.TCPStore(HOST, 0, replicas, is_master=True, timeout=span, wait_for_workers=False)
        threads = max(1, (os.cpu_count() or 1) // replicas)
        context = mp.get_context("spawn")
        self._processes = [
            context.Process(
                target=replica_main,
                args=(spec_bytes, rank, replicas, self._store.port, str(data_dir), owner, threads, timeout),
                name=f"nebula-replica-{rank}",
                daemon=True,
            )
            for rank in range(1, replicas)
        ]
        for process in self._processes:
            process.start()
        try:
            self.group = make_process_group(dist.PrefixStore("dp/", self._store), 0, replicas, timeout)
            if upstream:
                self.up = UpstreamCompute(program, self.group)
            elif middle:
                self.mid = MiddleCompute(program, self.group)
            else:
                self.compute = ReplicaCompute(program, self.group, micro_batches, backprop)
        except Exception as exc:
            self.abort()
            raise DataParallelError(f"data-parallel replicas did not start: {exc}") from exc

    def _broadcast_header(
        self, cmd: int, step: int, micro_batch: int = 0, tensor: torch.Tensor | None = None
    ) -> None:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[:3] = torch.tensor([cmd, step, micro_batch])
        if tensor is not None:
            if tensor.dim() > _HEADER - 5:
                raise DataParallelError(f"cannot scatter a tensor of {tensor.dim()} dimensions")
            header[3] = DTYPES.index(tensor.dtype)
            header[4] = tensor.dim()
            header[5 : 5 + tensor.dim()] = torch.tensor(tensor.shape)
        self.group.broadcast(header, 0).wait()

    def micro_batch(
        self, step: int, micro_batch: int, received: torch.Tensor, ids: list[int]
    ) -> tuple[float, torch.Tensor | None]:
        """Scatter a received micro-batch, compute every rank's share; (mean loss, gradient of received)."""
        if received.dtype not in DTYPES:
            raise DataParallelError(f"cannot scatter dtype {received.dtype}")
        received = received.detach().contiguous()
        self._broadcast_header(CMD_MICRO_BATCH, step, micro_batch, received)
        chunks = [chunk.contiguous() for chunk in received.chunk(self.replicas)]
        mine = torch.empty_like(chunks[0])
        self.group.scatter([mine], [chunks], _scatter_options()).wait()
        last = micro_batch == self.micro_batches - 1
        loss, grad = self.compute.run(mine, _rows(ids, 0, self.replicas), last)
        gathered: torch.Tensor | None = None
        if self.backprop and grad is not None:
            parts = [torch.empty_like(grad) for _ in range(self.replicas)]
            self.group.gather([parts], [grad], _gather_options()).wait()
            # The combined loss is the mean of the ranks' losses: each rank's rows get 1/n of its gradient.
            gathered = torch.cat(parts) / self.replicas
        self.group.allreduce([loss]).wait()
        return float(loss.item()) / self.replicas, gathered

    def forward(self, step: int, micro_batch: int, ids: list[int]) -> torch.Tensor:
        """Upstream: every rank runs its rows of the micro-batch; the gathered activation to send."""
        self._broadcast_header(CMD_FORWARD, step, micro_batch)
        mine = self.up.forward(micro_batch, _rows(ids, 0, self.replicas))
        parts = [torch.empty_like(mine) for _ in range(self.replicas)]
        self.group.gather([parts], [mine], _gather_options()).wait()
        out = torch.cat(parts)
        self._shapes[micro_batch] = out.shape
        return out

    def backward(self, step: int, micro_batch: int, grad: torch.Tensor) -> None:
        """Upstream: scatter the received gradient's rows to the ranks that made them; all backpropagate."""
        shape = self._shapes.pop(micro_batch)
        if grad.shape != shape:
            raise DataParallelError(f"gradient shape {tuple(grad.shape)} != activation {tuple(shape)}")
        if grad.dtype not in DTYPES:
            raise DataParallelError(f"cannot scatter dtype {grad.dtype}")
        grad = grad.detach().contiguous()
        self._broadcast_header(CMD_BACKWARD, step, micro_batch, grad)
        chunks = [chunk.contiguous() for chunk in grad.chunk(self.replicas)]
        mine = torch.empty_like(chunks[0])
        self.group.scatter([mine], [chunks], _scatter_options()).wait()
        self.up.backward(micro_batch, mine)

    def _scatter(self, cmd: int, step: int, micro_batch: int, tensor: torch.Tensor) -> torch.Tensor:
        """Send every rank its rows of ``tensor`` (after the command header); rank 0's own rows."""
        if tensor.dtype not in DTYPES:
            raise DataParallelError(f"cannot scatter dtype {tensor.dtype}")
        tensor = tensor.detach().contiguous()
        self._broadcast_header(cmd, step, micro_batch, tensor)
        chunks = [chunk.contiguous() for chunk in tensor.chunk(self.replicas)]
        mine = torch.empty_like(chunks[0])
        self.group.scatter([mine], [chunks], _scatter_options()).wait()
        return mine

    def _gather(self, mine: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(mine) for _ in range(self.replicas)]
        self.group.gather([parts], [mine], _gather_options()).wait()
        return torch.cat(parts)

    def relay(self, step: int, micro_batch: int, received: torch.Tensor, ids: list[int]) -> torch.Tensor:
        """Middle: every rank relays its rows of what came from above; the gathered output to send below."""
        mine = self._scatter(CMD_RELAY, step, micro_batch, received)
        out = self._gather(self.mid.forward(micro_batch, mine, _rows(ids, 0, self.replicas)))
        self._shapes[micro_batch] = out.shape
        return out

    def relay_backward(self, step: int, micro_batch: int, grad: torch.Tensor) -> torch.Tensor:
        """Middle: every rank backpropagates its rows of the gradient from below; the gathered one goes up."""
        shape = self._shapes.pop(micro_batch)
        if grad.shape != shape:
            raise DataParallelError(f"gradient shape {tuple(grad.shape)} != activation {tuple(shape)}")
        mine = self._scatter(CMD_RELAY_BACK, step, micro_batch, grad)
        return self._gather(self.mid.backward(micro_batch, mine))

    def finish_step(self, step: int) -> None:
        """Every rank steps its optimizer; a counter all-reduce confirms all replicas are at this step."""
        self._broadcast_header(CMD_STEP, step)
        if self.upstream:
            self.up.sum_gradients()
        elif self.middle:
            sum_gradients(self.program, self.group)
        self.program.finish_step()
        done = torch.tensor([float(step + 1)])
        self.group.allreduce([done]).wait()
        if int(done.item()) != (step + 1) * self.replicas:
            raise DataParallelError(f"replicas out of step after step {step}: counter {done.item()}")

    def stop(self) -> None:
        """Tell the replicas to exit and wait for them."""
        if self._stopped:
            return
        self._broadcast_header(CMD_STOP, 0)
        for process in self._processes:
            process.join(30)
        self.abort()

    def abort(self) -> None:
        """End every replica process now (our own children, by handle); safe to repeat."""
        self._stopped = True
        for process in self._processes:
            if process.is_alive():
                process.terminate()
        for process in self._processes:
            process.join(10)


def replica_main(
    spec_bytes: bytes,
    rank: int,
    world: int,
    port: int,
    data_dir: str,
    owner: str,
    threads: int,
    timeout: float,
) -> None:
    """Entry point of ranks 1..n-1 (a spawned process): build the stage, then follow rank 0's commands."""
    from nebula_common.proto.nebula.v1 import trainer_pb2
    from services.trainer.runtime.checkpoint import CheckpointStore
    from services.trainer.runtime.program import build_program, load_starting_state

    torch.set_num_threads(threads)
    spec = trainer_pb2.StageSpec.FromString(spec_bytes)
    cfg = spec.program
    program = build_program(spec)
    # Every replica starts from the same state as rank 0 (a checkpoint, or the hot-start state in the spec).
    load_starting_state(spec, program, CheckpointStore(Path(data_dir)), owner)
    span = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(HOST, port, world, is_master=False, timeout=span)
    group = make_process_group(dist.PrefixStore("dp/", store), rank, world, timeout)
    backprop = (cfg.mode or "backprop") == "backprop"
    upstream = cfg.role == "upstream"
    up = UpstreamCompute(program, group) if upstream else None
    mid = MiddleCompute(program, group) if cfg.role == "middle" else None
    compute = None if upstream or mid else ReplicaCompute(program, group, cfg.micro_batches, backprop)
    size = cfg.batch_size // cfg.micro_batches
    while True:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        group.broadcast(header, 0).wait()
        cmd, step, micro_batch = (int(v) for v in header[:3])
        if cmd == CMD_STOP:
            return
        if cmd == CMD_STEP:
            if up is not None:
                up.sum_gradients()
            elif mid is not None:
                sum_gradients(program, group)
            program.finish_step()
            done = torch.tensor([float(step + 1)])
            group.allreduce([done]).wait()
            continue
        ids = example_ids(cfg.seed, cfg.num_examples, step, micro_batch, cfg.micro_batches, size)
        if cmd == CMD_FORWARD and up is not None:
            out = up.forward(micro_batch, _rows(ids, rank, world))
            group.gather([], [out], _gather_options()).wait()
            continue
        ndim = int(header[4])
        shape = [int(v) for v in header[5 : 5 + ndim]]
        shape[0] //= world
        mine = torch.empty(shape, dtype=DTYPES[int(header[3])])
        group.scatter([mine], [], _scatter_options()).wait()
        if cmd == CMD_BACKWARD and up is not None:
            up.backward(micro_batch, mine)
            continue
        if cmd in (CMD_RELAY, CMD_RELAY_BACK) and mid is not None:
            if cmd == CMD_RELAY:
                out = mid.forward(micro_batch, mine, _rows(ids, rank, world))
            else:
                out = mid.backward(micro_batch, mine)
            group.gather([], [out], _gather_options()).wait()
            continue
        if compute is None:
            raise DataParallelError(f"command {cmd} does not apply to an upstream replica")
        loss, grad = compute.run(mine, _rows(ids, rank, world), micro_batch == cfg.micro_batches - 1)
        if backprop and grad is not None:
            group.gather([], [grad], _gather_options()).wait()
        group.allreduce([loss]).wait()
