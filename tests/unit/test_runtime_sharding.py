"""Sharded stages (FSDP2, HSDP) on real processes with gloo: they train as DDP does, hold less, and their
DCP checkpoints resume on another number of ranks.

Each run starts ``world`` processes that join one default process group (a TCPStore rendezvous on
127.0.0.1, as torchrun's), build the same small loss-owning stage, and train it on the same
micro-batches as the trainer's ranks do: every rank takes its rows of each micro-batch, gradients
are reduced in the last micro-batch's backward, the optimizer steps once per step.
"""

from __future__ import annotations

import json
import os
import time
import traceback
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nebula_common.jobspec.runtime import OptimSettings, StageProgram, example_ids, load_program
from services.trainer.runtime.replica_compute import ReplicaCompute
from services.trainer.runtime.sharding import (
    ShardedCompute,
    backend_for,
    full_parameters,
    load_sharded,
    parameter_bytes,
    save_sharded,
    stage_mesh,
)

pytestmark = pytest.mark.timeout(240)

EXAMPLES, BATCH, MICRO_BATCHES, SEED = 64, 16, 2, 3
SOURCE = """
import torch
from torch import nn

def build(options):
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))

def load_examples(options):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(64, 8, generator=g)
    return [(row, row.sum().sin().reshape(1)) for row in x]

def collate(examples):
    return torch.stack([target for _, target in examples])

def loss(model, received, batch):
    # calls a submodule directly, not model(...): the FSDP root must still gather everything first
    hidden = model[1](model[0](received))
    return ((model[4](model[3](model[2](hidden))) - batch) ** 2).mean()
"""


def _program(steps: int) -> StageProgram:
    module = load_program(SOURCE, "<tiny>", ("build", "load_examples", "collate", "loss"))
    optim = OptimSettings(
        name="adam", lr=1e-2, weight_decay=0.0, momentum=0.0, schedule="constant", warmup_steps=0
    )
    return StageProgram(
        module, {}, seed=SEED, stage_index=1, num_examples=EXAMPLES, optim=optim, total_steps=steps
    )


def _features(program: StageProgram, ids: list[int]) -> torch.Tensor:
    """What the upstream stage would have sent for these examples (here: their inputs)."""
    return torch.stack([program.examples[i][0] for i in ids])


def _train(
    program: StageProgram,
    compute: object | None,
    rank: int,
    world: int,
    start: int,
    steps: int,
    device: str = "cpu",
) -> list[float]:
    """Steps ``start..steps-1`` as the trainer runs them; the combined batch's loss per step."""
    size = BATCH // MICRO_BATCHES
    losses = []
    for step in range(start, steps):
        total = 0.0
        for micro_batch in range(MICRO_BATCHES):
            ids = example_ids(SEED, EXAMPLES, step, micro_batch, MICRO_BATCHES, size)
            rows = size // world
            mine = ids[rank * rows : (rank + 1) * rows]
            last = micro_batch == MICRO_BATCHES - 1
            if compute is None:  # one process, no group: the plain stage
                loss = program.loss(_features(program, mine), program.batch(mine)) / MICRO_BATCHES
                loss.backward()
                value = loss.detach().reshape(1)
            else:
                rows = _features(program, mine).to(device)
                value, _ = compute.run(rows, mine, last)  # type: ignore[attr-defined]
                dist.all_reduce(value)
                value /= world
            total += float(value.cpu().item())
        program.finish_step()
        losses.append(total)
    return losses


def _rank_main(rank: int, world: int, port: int, job: dict, out: str) -> None:
    try:
        torch.set_num_threads(1)
        steps = job["steps"]
        device = str(job.get("device", "cpu"))
        program = _program(steps)
        compute: object | None = None
        warned: list[str] = []
        if world > 1 or job["parallel"] != "plain":
            store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
            if device == "cuda":
                torch.cuda.set_device(rank)
            dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world)
            if job["parallel"] == "ddp":
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    compute = ReplicaCompute(program, dist.group.WORLD, MICRO_BATCHES, backprop=True)
                warned = [f"{w.category.__name__}: {w.message}" for w in caught]
            else:
                mesh = stage_mesh(job["parallel"], world, job.get("shard_size", 0), device)
                compute = ShardedCompute(program, mesh, MICRO_BATCHES, backprop=True)
        start = 0
        if job.get("load"):
            load_sharded(Path(job["load"]), program)
            start = job["load_step"]
        losses = _train(program, compute, rank, world, start, job.get("save_step", steps), device)
        if job.get("save"):
            save_sharded(Path(job["save"]), program)
            losses += _train(program, compute, rank, world, job["save_step"], steps, device)
        held = torch.tensor([float(parameter_bytes(program.model))], device=device)
        gathered = [torch.zeros(1, device=device) for _ in range(world)] if world > 1 else [held]
        if world > 1:
            dist.all_gather(gathered, held)
        params = [p.cpu() for p in full_parameters(program.model)]
        if rank == 0:
            torch.save(
                {
                    "losses": losses,
                    "params": params,
                    "bytes": [int(t.item()) for t in gathered],
                    "warnings": warned,
                },
                Path(out) / "result.pt",
            )
        if dist.is_initialized():
            dist.barrier()  # no rank leaves while another still needs the group
    except BaseException:
        (Path(out) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    (Path(out) / f"done-{rank}").touch()
    # Ended as the trainer's ranks end: gloo's teardown (in destroy_process_group or the interpreter's
    # exit) has hung a rank after the closing barrier and aborted another while a peer closed its end.
    os._exit(0)


def run(world: int, out: Path, **job: object) -> dict:
    """Run one job on ``world`` fresh processes; its rank 0's result, or fail with every rank's error."""
    out.mkdir(parents=True, exist_ok=True)
    context = mp.get_context("spawn")
    # This process hosts the ranks' store on a port it holds for the whole run (as torchrun's agent
    # does): a port probed free and released could be taken by anyone before rank 0 bound it.
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    port = store.port
    processes = [
        context.Process(target=_rank_main, args=(rank, world, port, job, str(out)), daemon=True)
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    done = [out / f"done-{rank}" for rank in range(world)]
    deadline = time.monotonic() + 150  # generous: the shared test machine may be busy
    try:
        # Finished when every rank has marked its work done, or one has failed or ended without it.
        while not all(marker.exists() for marker in done):
            ended = [
                p
                for p, marker in zip(processes, done, strict=True)
                if not p.is_alive() and not marker.exists()
            ]
            if ended or any(out.glob("error-*.txt")) or time.monotonic() > deadline:
                break
            processes[0].join(0.1)
        for process in processes:
            process.join(max(0.0, min(10.0, deadline - time.monotonic())))
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    errors = {p.name: p.read_text() for p in sorted(out.glob("error-*.txt"))}
    finished = [marker.exists() for marker in done]
    codes = [p.exitcode for p in processes]
    assert not errors and all(finished) and codes == [0] * world, (
        f"{json.dumps(job)} on {world} ranks: finished {finished}, exit codes {codes}\n{errors}"
    )
    return torch.load(out / "result.pt", weights_only=True)


STEPS = 20


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run(2, tmp_path_factory.mktemp("ddp"), parallel="ddp", steps=STEPS)


def _same_training(got: dict, ref: dict) -> None:
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    for step, (ours, theirs) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert ours == pytest.approx(theirs, abs=1e-5), f"step {step}"
    for ours, theirs in zip(got["params"], ref["params"], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_fsdp_on_two_ranks_trains_as_ddp_and_holds_half_the_parameters(ddp: dict, tmp_path: Path) -> None:
    fsdp = run(2, tmp_path, parallel="fsdp", steps=STEPS)
    _same_training(fsdp, ddp)
    whole = ddp["bytes"][0]
    assert ddp["bytes"] == [whole, whole]
    # dim-0 shards: each rank holds about half (a row count that does not split evenly pads one side)
    assert all(held < 0.6 * whole for held in fsdp["bytes"]), (fsdp["bytes"], whole)
    assert sum(fsdp["bytes"]) == pytest.approx(whole, rel=0.05)
    assert ddp["losses"][-1] < ddp["losses"][0]  # it did train


def test_a_replica_starts_without_a_warning_in_the_stage_log(ddp: dict) -> None:
    """torch 2.13 deprecates ``broadcast_buffers``; a warning there would land in every DDP stage's log."""
    assert ddp["warnings"] == []


@pytest.mark.long  # four ranks; in `make test-faults`
def test_hsdp_on_four_ranks_trains_as_ddp_and_shards_inside_groups_of_two(ddp: dict, tmp_path: Path) -> None:
    hsdp = run(4, tmp_path, parallel="hsdp", shard_size=2, steps=STEPS)
    _same_training(hsdp, ddp)
    whole = ddp["bytes"][0]
    assert all(held < 0.6 * whole for held in hsdp["bytes"]), (hsdp["bytes"], whole)
    # two replicate groups of two shards: the four ranks together hold the model twice
    assert sum(hsdp["bytes"]) == pytest.approx(2 * whole, rel=0.05)


@pytest.fixture(scope="module")
def saved_on_two(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("saved")
    result = run(2, out, parallel="fsdp", steps=4, save=str(out / "dcp"), save_step=3)
    return out / "dcp", result


@pytest.mark.parametrize(
    ("world", "parallel"),
    [  # resharding checkpoints: `make test-faults`
        pytest.param(1, "plain", marks=pytest.mark.long),
        pytest.param(4, "hsdp", marks=pytest.mark.long),
    ],
)
def test_a_checkpoint_saved_on_two_ranks_resumes_on_another_count_with_the_same_next_loss(
    saved_on_two: tuple[Path, dict], world: int, parallel: str, tmp_path: Path
) -> None:
    directory, uninterrupted = saved_on_two
    resumed = run(world, tmp_path, parallel=parallel, shard_size=2, steps=4, load=str(directory), load_step=3)
    assert resumed["losses"] == [pytest.approx(uninterrupted["losses"][3], abs=1e-5)]
    for ours, theirs in zip(resumed["params"], uninterrupted["params"], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def needs_gpus(count: int) -> pytest.MarkDecorator:
    """Skip, saying why, where fewer than ``count`` CUDA devices exist (a CPU build of torch has none)."""
    have = torch.cuda.device_count()
    return pytest.mark.skipif(
        have < count, reason=f"NCCL: needs {count} CUDA devices; this machine has {have}"
    )


@needs_gpus(2)
def test_fsdp_on_two_gpus_with_nccl_trains_as_ddp_on_gloo(ddp: dict, tmp_path: Path) -> None:
    fsdp = run(2, tmp_path, parallel="fsdp", steps=STEPS, device="cuda")
    _same_training(fsdp, ddp)


@needs_gpus(4)
def test_hsdp_on_four_gpus_with_nccl_trains_as_ddp_on_gloo(ddp: dict, tmp_path: Path) -> None:
    hsdp = run(4, tmp_path, parallel="hsdp", shard_size=2, steps=STEPS, device="cuda")
    _same_training(hsdp, ddp)
    whole = ddp["bytes"][0]
    assert all(held < 0.6 * whole for held in hsdp["bytes"]), (hsdp["bytes"], whole)


@needs_gpus(4)
def test_a_checkpoint_saved_on_two_gpus_resumes_on_four_with_nccl_and_the_same_next_loss(
    tmp_path: Path,
) -> None:
    saved = tmp_path / "saved"
    uninterrupted = run(
        2, saved, parallel="fsdp", steps=4, save=str(saved / "dcp"), save_step=3, device="cuda"
    )
    resumed = run(
        4,
        tmp_path / "resumed",
        parallel="hsdp",
        shard_size=2,
        steps=4,
        load=str(saved / "dcp"),
        load_step=3,
        device="cuda",
    )
    assert resumed["losses"] == [pytest.approx(uninterrupted["losses"][3], abs=1e-5)]
    for ours, theirs in zip(resumed["params"], uninterrupted["params"], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
