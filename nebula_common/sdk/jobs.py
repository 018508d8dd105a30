"""The job model the SDK submits: one validated description, split into per-cluster stage specs."""

from __future__ import annotations

import uuid

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from nebula_common.codec import CodecError, get_codec
from nebula_common.proto.nebula.v1 import trainer_pb2


class AbnetJob(BaseModel):
    """An ABNet-style split job: encoder stage in the source cluster, decoder stage in the target."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str = Field(
        default_factory=lambda: f"abnet-{uuid.uuid4().hex[:8]}", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
    )
    steps: int = Field(60, ge=1, le=1_000_000)
    codec_forward: str = "none"
    codec_backward: str = "none"
    d_model: int = Field(128, ge=8, le=4096)
    n_heads: int = Field(4, ge=1)
    n_layers: int = Field(2, ge=1, le=48)
    batch_size: int = Field(128, ge=1)
    micro_batches: int = Field(2, ge=1)
    learning_rate: float = Field(1e-3, gt=0, lt=1)
    seed: int = Field(0, ge=0)
    edge: str = "encoder->decoder"

    @field_validator("codec_forward", "codec_backward")
    @classmethod
    def _known_codec(cls, value: str) -> str:
        try:
            return get_codec(value).spec
        except CodecError as exc:
            raise ValueError(str(exc)) from exc

    @model_validator(mode="after")
    def _shapes_fit(self) -> AbnetJob:
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads {self.n_heads} must divide d_model {self.d_model}")
        if self.batch_size % self.micro_batches:
            raise ValueError(
                f"batch_size {self.batch_size} must be a multiple of micro_batches {self.micro_batches}"
            )
        return self

    def stage_spec(self, stage: str) -> trainer_pb2.StageSpec:
        return trainer_pb2.StageSpec(
            job_id=self.job_id,
            scenario="abnet",
            stage=stage,
            edge=self.edge,
            steps=self.steps,
            codec_forward=self.codec_forward,
            codec_backward=self.codec_backward,
            abnet=trainer_pb2.AbnetConfig(
                d_model=self.d_model,
                n_heads=self.n_heads,
                n_layers=self.n_layers,
                batch_size=self.batch_size,
                micro_batches=self.micro_batches,
                learning_rate=self.learning_rate,
                seed=self.seed,
            ),
        )
