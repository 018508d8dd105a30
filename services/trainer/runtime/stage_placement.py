"""Who computes a stage's attempt: the stage thread itself, data-parallel replicas, or rank processes.

Why a module of its own: the choice depends only on the spec and on what the trainer has (its
cluster's own ranks, or none), never on the stage's role; the step loops then only ask whether a
group computes for them, and the checkpoints are written by whoever holds the state.
"""

from __future__ import annotations

from nebula_common.jobspec.runtime import ProgramError, StageProgram
from nebula_common.jobspec.spec import sharding_problem
from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer.rank_accounts import may_use_ranks
from services.trainer.runtime.checkpoint import CheckpointStore
from services.trainer.runtime.parallel import DataParallelGroup
from services.trainer.runtime.rank_group import RankGroup, Ranks, RankSource
from services.trainer.runtime.rank_sources import SpawnedRanks
from services.trainer.runtime.sharding import SHARDED


def rank_processes(
    spec: trainer_pb2.StageSpec, cluster_ranks: RankSource | None, store: CheckpointStore, owner: str
) -> Ranks | None:
    """The rank processes this attempt computes on, if not the stage thread itself (or DDP replicas).

    The cluster's own ranks (``ClusterRanks``, or ``BoxedRanks`` from a stage process) take every
    stage that may run data-parallel, whatever its ``replicas``: the same spec runs on 1 rank or
    many. A sharded stage on a trainer without them gets ``replicas`` spawned ranks.
    """
    cfg = spec.program
    if cluster_ranks is not None and may_use_ranks(spec):  # see validation: one process
        world = cluster_ranks.world
        micro = cfg.batch_size // cfg.micro_batches
        problem = sharding_problem(cfg.parallel or "ddp", max(world, 2), cfg.shard_size or None)
        problems = [f"program.{problem}"] if problem else []
        if micro % world:
            problems.append(f"they split each micro-batch evenly; {world} does not divide {micro}")
        if problems:
            raise ProgramError(f"this cluster's {world} ranks cannot run the stage: {'; '.join(problems)}")
        return cluster_ranks.attach(spec.SerializeToString(), owner)
    if cfg.replicas > 1 and cfg.parallel in SHARDED:
        return SpawnedRanks(spec.SerializeToString(), cfg.replicas, str(store.root), owner)
    return None


def compute_group(
    start_spec: trainer_pb2.StageSpec,
    program: StageProgram,
    cluster_ranks: RankSource | None,
    store: CheckpointStore,
    owner: str,
) -> tuple[DataParallelGroup | RankGroup | None, dict[str, object]]:
    """The group that computes the attempt's steps with the stage thread (None: the thread alone),
    and where the stage runs, for its "program stage running" log record.

    ``start_spec``: the stage's spec as this attempt starts it (a recovery's resume checkpoint), so
    replicas and ranks load the same starting state as the stage thread.
    """
    cfg = start_spec.program
    upstream, middle = cfg.role == "upstream", cfg.role == "middle"
    backprop = cfg.mode != "one_way"
    ranks = rank_processes(start_spec, cluster_ranks, store, owner)
    placement: dict[str, object] = {"ranks": ranks.world if ranks is not None else max(cfg.replicas, 1)}
    if cluster_ranks is not None and ranks is not None and not isinstance(ranks, SpawnedRanks):
        placement["rank_hosts"] = [str(w.get("host", "?")) for w in cluster_ranks.joined()]
    if ranks is not None:
        group = RankGroup(
            ranks,
            program,
            micro_batches=cfg.micro_batches,
            backprop=backprop,
            store=store,
            owner=owner,
            upstream=upstream,
            middle=middle,
        )
        placement["rank_parameter_bytes"] = group.parameter_bytes
        return group, placement
    if cfg.replicas > 1:
        replicas = DataParallelGroup(
            start_spec.SerializeToString(),
            program,
            replicas=cfg.replicas,
            micro_batches=cfg.micro_batches,
            backprop=backprop,
            data_dir=store.root,
            owner=owner,
            upstream=upstream,
            middle=middle,
        )
        return replicas, placement
    return None, placement


def save_checkpoint(
    spec: trainer_pb2.StageSpec,
    step: int,
    program: StageProgram,
    group: DataParallelGroup | RankGroup | None,
    store: CheckpointStore,
    owner: str,
) -> None:
    """The checkpoint after ``step`` completed steps, written by whoever holds the stage's state: every
    rank its part (rank processes, possibly sharded), else the stage thread (replicas hold copies)."""
    if isinstance(group, RankGroup):  # every rank writes its part
        group.save_checkpoint(spec.job_id, spec.stage, step, final=step == spec.steps)
    else:
        store.save(spec.job_id, spec.stage, owner, step, program)


__all__ = ["compute_group", "rank_processes", "save_checkpoint"]
