"""One compute rank of a stage driven by the trainer (see ``rank_group``): follow the driver's commands.

The same loop runs in a rank the trainer spawned (a sharded stage, ``spawned_rank_main``) and in a
rank started on its own (``services/trainer/worker.py``, torchrun-style), for every ``parallel``:
``ddp`` computes through DDP on the compute group (a middle or upstream stage sums its gradients at
the step boundary instead), ``fsdp``/``hsdp`` through FSDP2 on a mesh over it.
Checkpoints of a stage on rank processes are always DCP (a ddp stage's ranks all hold the whole
model; DCP writes each tensor once), so they reshard on load like a sharded stage's.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist

from nebula_common.jobspec.runtime import StageProgram, example_ids
from services.trainer.runtime.checkpoint import CheckpointStore
from services.trainer.runtime.parallel import (
    _HEADER,
    CMD_BACKWARD,
    CMD_FORWARD,
    CMD_STEP,
    CMD_STOP,
    _gather_options,
    _rows,
    make_process_group,
)
from services.trainer.runtime.replica_compute import (
    DTYPES,
    DataParallelError,
    MiddleCompute,
    ReplicaCompute,
    UpstreamCompute,
    sum_gradients,
)
from services.trainer.runtime.sharding import (
    SHARDED,
    ShardedCompute,
    ShardedMiddle,
    ShardedUpstream,
    backend_for,
    parameter_bytes,
    save_sharded,
    stage_mesh,
)

CMD_SAVE = 5
# A chain's middle stage: its rows of what came from above relayed, then their gradient from below
# (this protocol's own numbers: ``parallel``'s CMD_RELAY is 5, which is CMD_SAVE here).
CMD_MIDDLE_FORWARD, CMD_MIDDLE_BACKWARD = 7, 8


def header(cmd: int, step: int, micro_batch: int = 0, tensor: torch.Tensor | None = None) -> torch.Tensor:
    """A command: what, for which step and micro-batch, and the dtype and shape of a tensor that follows."""
    out = torch.zeros(_HEADER, dtype=torch.int64)
    out[:3] = torch.tensor([cmd, step, micro_batch])
    if tensor is not None:
        if tensor.dim() > _HEADER - 5:
            raise DataParallelError(f"cannot send a tensor of {tensor.dim()} dimensions to the ranks")
        if tensor.dtype not in DTYPES:
            raise DataParallelError(f"cannot send dtype {tensor.dtype} to the ranks")
        out[3] = DTYPES.index(tensor.dtype)
        out[4] = tensor.dim()
        out[5 : 5 + tensor.dim()] = torch.tensor(tensor.shape)
    return out


def empty_like_header(command: torch.Tensor) -> torch.Tensor:
    ndim = int(command[4])
    return torch.empty([int(v) for v in command[5 : 5 + ndim]], dtype=DTYPES[int(command[3])])


def device_type() -> str:
    """The device this rank computes on: CUDA when present (NCCL), else the CPU (gloo)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def join_compute_group(store: dist.Store | None, rank: int, world: int, timeout: float) -> str:
    """Make this process a rank of torch.distributed's default group; its device type.

    On ``store``, or (None) by the standard c10d rendezvous ``env://`` (MASTER_ADDR/PORT, or
    torchrun's agent store).
    """
    device = device_type()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    span = datetime.timedelta(seconds=timeout)
    backend = backend_for(device)
    if store is None:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=span)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=span)
    return device


class _Compute:
    """This rank's part of the stage for its ``parallel``: DDP on the default group, or FSDP2 on a mesh."""

    def __init__(
        self,
        program: StageProgram,
        parallel: str,
        shard_size: int,
        micro_batches: int,
        *,
        upstream: bool,
        backprop: bool,
        device: str,
        middle: bool = False,
    ) -> None:
        world = dist.get_world_size()
        self.program = program
        self.up: ShardedUpstream | UpstreamCompute | None = None
        self.down: ShardedCompute | ReplicaCompute | None = None
        self.mid: ShardedMiddle | MiddleCompute | None = None
        self._sum_at_step = False
        if parallel in SHARDED:
            mesh = stage_mesh(parallel, world, shard_size, device)
            if middle:
                self.mid = ShardedMiddle(program, mesh, micro_batches)
            elif upstream:
                self.up = ShardedUpstream(program, mesh, micro_batches)
            else:
                self.down = ShardedCompute(program, mesh, micro_batches, backprop)
        elif device != "cpu":
            raise DataParallelError("a ddp stage on rank processes runs on the CPU; shard it (fsdp) on CUDA")
        elif middle:  # gradients summed at the step boundary, as upstream (see ``parallel``)
            self.mid = MiddleCompute(program, dist.group.WORLD)  # type: ignore[arg-type]
            self._sum_at_step = True
        elif upstream:
            self.up = UpstreamCompute(program, dist.group.WORLD)  # type: ignore[arg-type]
            self._sum_at_step = True
        else:
            self.down = ReplicaCompute(program, dist.group.WORLD, micro_batches, backprop)  # type: ignore[arg-type]

    def finish_step(self) -> None:
        if self._sum_at_step and isinstance(self.up, UpstreamCompute):
            self.up.sum_gradients()
        elif self._sum_at_step and isinstance(self.mid, MiddleCompute):
            sum_gradients(self.program, dist.group.WORLD)  # type: ignore[arg-type]
        self.program.finish_step()


def join_commands(stage_store: dist.Store, rank: int, world: int, timeout: float) -> dist.ProcessGroup:
    """This rank's place in the stage's command group (the driver is its rank 0).

    A rank's box joins it first, before its compute group: a box that dies after this breaks the
    driver's collectives at once (and the driver says which rank), rather than leaving it waiting.
    """
    return make_process_group(dist.PrefixStore("cmd/", stage_store), rank + 1, world + 1, timeout)


def follow(
    spec_bytes: bytes,
    rank: int,
    world: int,
    stage_store: dist.Store,
    data_dir: Path,
    owner: str,
    timeout: float,
    commands: dist.ProcessGroup | None = None,
) -> None:
    """Build this rank's part of the stage, say ready, then follow the driver until CMD_STOP.

    The default group (``join_compute_group``) must exist already; ``stage_store`` is this stage's
    command store (``commands``: the command group, when this rank joined it already).
    """
    from nebula_common.proto.nebula.v1 import trainer_pb2
    from services.trainer.runtime.program import build_program, load_starting_state

    spec = trainer_pb2.StageSpec.FromString(spec_bytes)
    cfg = spec.program
    if commands is None:
        commands = join_commands(stage_store, rank, world, timeout)
    device = device_type()
    store = CheckpointStore(data_dir)
    program = build_program(spec)
    backprop = (cfg.mode or "backprop") == "backprop"
    upstream = cfg.role == "upstream"
    compute = _Compute(
        program,
        cfg.parallel or "ddp",
        cfg.shard_size,
        cfg.micro_batches,
        upstream=upstream,
        backprop=backprop,
        device=device,
        middle=cfg.role == "middle",
    )
    load_starting_state(spec, program, store, owner)  # after sharding: DCP loads into the shards
    # What this rank holds (its shards only when sharded), for the stage's log record.
    stage_store.set(f"parameter_bytes/{rank}", str(parameter_bytes(program.model)))
    commands.allreduce([torch.ones(1)]).wait()  # ready
    move = torch.device(device)
    size = cfg.batch_size // cfg.micro_batches
    while True:
        command = torch.zeros(_HEADER, dtype=torch.int64)
        commands.broadcast(command, 0).wait()
        cmd, step, micro_batch = (int(v) for v in command[:3])
        if cmd == CMD_STOP:
            return
        if cmd == CMD_STEP:
            compute.finish_step()
            commands.allreduce([torch.tensor([float(step + 1)])]).wait()
            continue
        if cmd == CMD_SAVE:
            directory = store.sharded_partial(owner, spec.job_id, spec.stage, step)
            save_sharded(directory / "dcp", program)
            if rank == 0:
                torch.save(program.scheduler.state_dict(), directory / "scheduler.pt")
            commands.allreduce([torch.ones(1)]).wait()
            continue
        ids = example_ids(cfg.seed, cfg.num_examples, step, micro_batch, cfg.micro_batches, size)
        mine = _rows(ids, rank, world)
        if cmd == CMD_FORWARD and compute.up is not None:
            out = compute.up.forward(micro_batch, mine).cpu()
            shape = header(0, 0, 0, out) if rank == 0 else torch.zeros(_HEADER, dtype=torch.int64)
            commands.broadcast(shape, 1).wait()
            commands.gather([], [out], _gather_options()).wait()
            continue
        whole = empty_like_header(command)
        commands.broadcast(whole, 0).wait()
        rows = whole.chunk(world)[rank].contiguous().to(move)
        if cmd in (CMD_MIDDLE_FORWARD, CMD_MIDDLE_BACKWARD) and compute.mid is not None:
            if cmd == CMD_MIDDLE_FORWARD:
                out = compute.mid.forward(micro_batch, rows, mine).cpu()
                shape = header(0, 0, 0, out) if rank == 0 else torch.zeros(_HEADER, dtype=torch.int64)
                commands.broadcast(shape, 1).wait()  # the output's shape and dtype, from rank 0
            else:
                out = compute.mid.backward(micro_batch, rows).cpu()
            commands.gather([], [out], _gather_options()).wait()
            continue
        if cmd == CMD_BACKWARD and compute.up is not None:
            compute.up.backward(micro_batch, rows)
            continue
        if compute.down is None:
            raise DataParallelError(f"command {cmd} does not apply to an upstream or middle rank")
        loss, grad = compute.down.run(rows, mine, micro_batch == cfg.micro_batches - 1)
        if backprop and grad is not None:
            commands.gather([], [grad.cpu()], _gather_options()).wait()
        commands.allreduce([loss.cpu()]).wait()


def report_failure(stage_store: dist.Store, rank: int, exc: BaseException) -> None:
    """Leave why this rank stopped where the driver looks (best effort: the store may be gone too)."""
    with contextlib.suppress(Exception):  # the driver then reports the rank as gone without a reason
        stage_store.set(f"error/{rank}", f"{type(exc).__name__}: {exc}")
        # A set gets no answer; a check does, after the set (one connection, in order): the reason
        # is in the store before this rank exits, even through a worker's TLS tunnel (rank_gate).
        stage_store.check([f"error/{rank}"])


def spawned_rank_main(
    spec_bytes: bytes,
    rank: int,
    world: int,
    port: int,
    data_dir: str,
    owner: str,
    threads: int,
    timeout: float,
) -> None:
    """Entry point of compute rank ``rank`` that the trainer spawned (``SpawnedRanks``)."""
    from services.trainer.runtime.parallel import HOST

    torch.set_num_threads(threads)
    span = datetime.timedelta(seconds=timeout)
    tcp = dist.TCPStore(HOST, port, world + 1, is_master=False, timeout=span)
    try:
        join_compute_group(dist.PrefixStore("compute/", tcp), rank, world, timeout)
        follow(spec_bytes, rank, world, tcp, Path(data_dir), owner, timeout)
    except Exception as exc:
        report_failure(tcp, rank, exc)
        raise


__all__ = [
    "CMD_MIDDLE_BACKWARD",
    "CMD_MIDDLE_FORWARD",
    "CMD_SAVE",
    "device_type",
    "empty_like_header",
    "follow",
    "header",
    "join_commands",
    "join_compute_group",
    "report_failure",
    "spawned_rank_main",
]
