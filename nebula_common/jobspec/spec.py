"""The job spec a user writes (YAML): a validated model whose errors name the field (``loader.py``
reads one from a file, text or mapping, and checks the stage modules it names).

Why a real config model: a spec mistake found after one cluster already started
its stage wastes two organisations' hardware and leaves a half-job behind. So
the whole spec, the stage modules it points at (read and compiled, not run) and
the codec of every edge are checked before anything is sent anywhere.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from nebula_common.errors import InvalidRequestError

MAX_MODULE_BYTES = 4 << 20  # shipped in one gRPC message with the stage spec
_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
UPSTREAM_FUNCTIONS = ("build", "load_examples", "collate")
DOWNSTREAM_FUNCTIONS = ("build", "load_examples", "collate", "loss")
# One-way edges (ELECTRA): the upstream stage trains on its own loss and sends what it produced.
ONE_WAY_UPSTREAM_FUNCTIONS = ("build", "load_examples", "collate", "produce")
# A middle stage of a chain: its model takes what arrived from upstream (``forward(model, received,
# batch)`` if the module defines it, else ``model(received)``) and its output goes downstream.
MIDDLE_FUNCTIONS = ("build", "load_examples", "collate")
MAX_STAGES = 8


def required_functions(role: str, mode: str) -> tuple[str, ...]:
    """Functions a stage module must define, by its role (upstream/middle/downstream) and pipeline mode."""
    if role == "downstream":
        return DOWNSTREAM_FUNCTIONS
    if role == "middle":
        return MIDDLE_FUNCTIONS
    return ONE_WAY_UPSTREAM_FUNCTIONS if mode == "one_way" else UPSTREAM_FUNCTIONS


def stage_role(index: int, stages: int) -> str:
    """The role of stage ``index`` in a chain of ``stages``: upstream (first), middle or downstream (last)."""
    if index == 0:
        return "upstream"
    return "downstream" if index == stages - 1 else "middle"


def sharding_problem(parallel: str, replicas: int, shard_size: int | None) -> str | None:
    """What is wrong with a stage's ``parallel``/``shard_size`` for its replicas (None: nothing).

    The message starts with the field it is about, so both the spec (``stages.N.``) and the
    trainer's StageSpec check (``program.``) can prefix it.
    """
    if parallel == "ddp":
        return None if shard_size is None else "shard_size: only an hsdp stage has shard groups"
    if replicas < 2:
        return (
            f"parallel: {parallel} shards a stage across its replicas; it needs replicas >= 2, got {replicas}"
        )
    if parallel == "fsdp":
        return None if shard_size is None else "shard_size: fsdp shards across all replicas; use hsdp"
    if shard_size is None:
        return "shard_size: hsdp needs the ranks per shard group (2..replicas-1, dividing replicas)"
    if shard_size >= replicas or replicas % shard_size:
        return (
            f"shard_size: {shard_size} must divide replicas {replicas} and be below it "
            "(hsdp: at least 2 shard groups replicating each other)"
        )
    return None


class SpecError(InvalidRequestError):
    """A job spec (or a module it names) is invalid; the message names the file and field."""


class _Strict(BaseModel):
    # NaN and infinity are refused as such ("finite number"): NaN fails every bound silently, so
    # without this `lr: .nan` is reported as "should be greater than 0".
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class OptimizerSpec(_Strict):
    name: Literal["adam", "adamw", "sgd"] = "adam"
    lr: float = Field(1e-3, gt=0, lt=10)
    weight_decay: float = Field(0.0, ge=0, lt=1)
    momentum: float = Field(0.0, ge=0, lt=1)


class LrScheduleSpec(_Strict):
    name: Literal["constant", "linear_warmup", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)


class DataSpec(_Strict):
    batch_size: int = Field(ge=1, le=1_000_000)
    micro_batches: int = Field(1, ge=1, le=4096)
    examples: int = Field(ge=1, description="Examples each cluster's shard holds; ids are 0..examples-1.")

    @model_validator(mode="after")
    def _even_split(self) -> DataSpec:
        if self.batch_size % self.micro_batches:
            raise ValueError(
                f"batch_size {self.batch_size} must be a multiple of micro_batches {self.micro_batches}"
            )
        return self


class PipelineSpec(_Strict):
    schedule: Literal["gpipe", "1f1b"] = "gpipe"
    max_in_flight: int = Field(4, ge=1, le=256)
    mode: Literal["backprop", "one_way"] = Field(
        "backprop",
        description="backprop: activations forward, their gradients back (ABNet). one_way: the upstream "
        "stage trains on its own loss and only its output crosses (ELECTRA generator -> discriminator); "
        "after each optimizer step the downstream stage returns a small sync tensor.",
    )
    sync_lag: int = Field(
        1,
        ge=0,
        le=64,
        description="one_way: optimizer steps the upstream stage may run ahead of the downstream one "
        "(0 = lockstep; 1 lets the generator compute step s+1 while the discriminator trains on step s).",
    )


class CheckpointSpec(_Strict):
    interval: int = Field(0, ge=0, description="Checkpoint every N steps; 0 = only at the end.")


class StageDecl(_Strict):
    name: str = Field(pattern=_NAME)
    cluster: str = Field(pattern=r"^[a-z][a-z0-9-]{0,30}$")
    module: str = Field(min_length=1, description="Path of the stage's Python module, relative to the spec.")
    options: dict[str, Any] = Field(default_factory=dict)
    replicas: int = Field(
        1,
        ge=1,
        le=64,
        description="Data-parallel processes of this stage inside its cluster (torch.distributed, DDP); "
        "rank 0 talks to the switch and scatters each micro-batch's rows to the others.",
    )
    parallel: Literal["ddp", "fsdp", "hsdp"] = Field(
        "ddp",
        description="How the replicas hold the parameters: ddp (full copies, gradients all-reduced), "
        "fsdp (PyTorch FSDP2: each rank holds 1/replicas of every parameter and optimizer state) or "
        "hsdp (shards inside groups of shard_size ranks that replicate each other). Sharded stages "
        "checkpoint with torch.distributed.checkpoint and can resume on another number of ranks.",
    )
    shard_size: int | None = Field(
        None, ge=2, le=64, description="hsdp only: ranks per shard group (divides replicas, below it)."
    )
    dataset: str | None = Field(
        None,
        pattern=r"^[a-z0-9][a-z0-9._-]{2,63}/[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
        description="OWNER/NAME of a dataset in this stage's cluster's data service to train on instead of "
        "load_examples(): read batch by batch through the service, so the owner's grant governs every batch.",
    )

    @field_validator("options")
    @classmethod
    def _json_options(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"options must be plain YAML data (finite numbers, strings, lists, maps): {exc}"
            ) from exc
        return value


class CodecPair(_Strict):
    forward: str = "none"
    backward: str = "none"

    @field_validator("forward", "backward")
    @classmethod
    def _known_codec(cls, value: str) -> str:
        from nebula_common.codec import CodecError, get_codec  # torch: only when a spec is parsed

        try:
            return get_codec(value).spec
        except CodecError as exc:
            raise ValueError(str(exc)) from exc


class EdgeDecl(_Strict):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)

    source: str = Field(alias="from")
    target: str = Field(alias="to")
    codec: CodecPair = Field(default_factory=CodecPair)
    payload: Literal["float", "int64"] = Field(
        "float",
        description="What the upstream stage sends: float activations, or int64 ids (token ids, "
        "one_way mode only; carried exactly as int64 bytes, whatever the float codec).",
    )

    @property
    def name(self) -> str:
        return f"{self.source}->{self.target}"


class JobSpec(_Strict):
    """A cross-cluster pipeline: a chain of 2..8 stages, stage 0 upstream, the last downstream (owns the
    loss), any stages between them middles; ``edges.K`` goes from stage K to stage K+1."""

    name: str = Field(pattern=_NAME)
    steps: int = Field(ge=1, le=10_000_000)
    seed: int = Field(0, ge=0, le=2**62)
    data: DataSpec
    pipeline: PipelineSpec = Field(default_factory=PipelineSpec)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    lr_schedule: LrScheduleSpec = Field(default_factory=LrScheduleSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    stages: list[StageDecl] = Field(min_length=2, max_length=MAX_STAGES)
    edges: list[EdgeDecl] = Field(min_length=1, max_length=MAX_STAGES - 1)

    @model_validator(mode="after")
    def _topology(self) -> JobSpec:
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stages: names must be unique, got {names}")
        clusters = [s.cluster for s in self.stages]
        if len(set(clusters)) != len(clusters):
            raise ValueError(f"stages: each stage must run in a different cluster, got {clusters}")
        if len(self.edges) != len(names) - 1:
            raise ValueError(
                f"edges: {len(names)} stages form a chain of {len(names) - 1} edge(s) "
                f"(stage K -> stage K+1), got {len(self.edges)}"
            )
        for index, chained in enumerate(self.edges):
            if (chained.source, chained.target) != (names[index], names[index + 1]):
                which = (
                    "the first stage to the second" if index == 0 else f"stage {index} to stage {index + 1}"
                )
                raise ValueError(
                    f"edges.{index}: must go from {which} ({names[index]} -> {names[index + 1]}), "
                    f"got {chained.source} -> {chained.target}"
                )
        one_way = self.pipeline.mode == "one_way"
        if len(names) > 2:
            self._chain_checks(one_way)
        edge = self.edges[0]
        if one_way and edge.codec.backward != "none":
            raise ValueError(
                "edges.0.codec.backward: a one_way edge carries only the per-step sync tensor back; "
                f"it must be none, got {edge.codec.backward!r}"
            )
        if edge.payload == "int64":
            if not one_way:
                raise ValueError(
                    "edges.0.payload: int64 ids have no gradient; they need pipeline.mode one_way"
                )
            if edge.codec.forward != "none":
                raise ValueError(
                    "edges.0.codec.forward: an int64 payload (ids) must use codec none; a lossy codec "
                    f"would change ids, got {edge.codec.forward!r}"
                )
        if one_way and self.stages[0].replicas != 1:
            # The generator trains on its own loss, which may sample: replicas would not reproduce it.
            raise ValueError("stages.0.replicas: a one_way upstream (first) stage runs on one process")
        micro_batch = self.data.batch_size // self.data.micro_batches
        for index, stage in enumerate(self.stages):
            problem = sharding_problem(stage.parallel, stage.replicas, stage.shard_size)
            if problem is not None:
                raise ValueError(f"stages.{index}.{problem}")
            if micro_batch % stage.replicas:
                raise ValueError(
                    f"stages.{index}.replicas: each micro-batch ({micro_batch} examples) is split evenly "
                    f"across replicas; {stage.replicas} does not divide it"
                )
        return self

    def _chain_checks(self, one_way: bool) -> None:
        """What a chain of more than two stages cannot do (yet), each refused naming its field."""
        if one_way:
            raise ValueError(
                f"pipeline.mode: one_way (ELECTRA: generator -> discriminator) is a two-stage shape; "
                f"a chain of {len(self.stages)} stages needs mode backprop"
            )
        for index, chained in enumerate(self.edges):
            if chained.payload != "float":
                raise ValueError(
                    f"edges.{index}.payload: int64 ids have no gradient; a chain carries float activations"
                )

    @property
    def edge(self) -> EdgeDecl:
        """The first edge (the only one of a two-stage job)."""
        return self.edges[0]
