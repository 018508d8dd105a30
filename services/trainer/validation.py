"""Validation of a StageSpec before anything starts: each bad field named."""

from __future__ import annotations

import re

from nebula_common.codec import CodecError, get_codec
from nebula_common.errors import InvalidRequestError
from nebula_common.proto.nebula.v1 import trainer_pb2

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
STAGES = ("encoder", "decoder")


def validate_stage_spec(spec: trainer_pb2.StageSpec) -> None:
    problems: list[str] = []
    if not _ID.match(spec.job_id):
        problems.append(f"job_id {spec.job_id!r} must be 1-128 chars of [A-Za-z0-9._-]")
    if spec.scenario != "abnet":
        problems.append(f"scenario {spec.scenario!r} is not supported (supported: 'abnet')")
    if spec.stage not in STAGES:
        problems.append(f"stage {spec.stage!r} must be one of {', '.join(STAGES)}")
    if not spec.edge:
        problems.append("edge is required")
    if not 1 <= spec.steps <= 1_000_000:
        problems.append(f"steps {spec.steps} must be in 1..1000000")
    for name in ("codec_forward", "codec_backward"):
        try:
            get_codec(getattr(spec, name) or "none")
        except CodecError as exc:
            problems.append(f"{name}: {exc}")
    cfg = spec.abnet
    if not 8 <= cfg.d_model <= 4096:
        problems.append(f"abnet.d_model {cfg.d_model} must be in 8..4096")
    elif cfg.n_heads < 1 or cfg.d_model % cfg.n_heads:
        problems.append(f"abnet.n_heads {cfg.n_heads} must be >= 1 and divide d_model {cfg.d_model}")
    if not 1 <= cfg.n_layers <= 48:
        problems.append(f"abnet.n_layers {cfg.n_layers} must be in 1..48")
    if cfg.micro_batches < 1:
        problems.append("abnet.micro_batches must be >= 1")
    elif cfg.batch_size < cfg.micro_batches or cfg.batch_size % cfg.micro_batches:
        problems.append(
            f"abnet.batch_size {cfg.batch_size} must be a positive multiple of "
            f"micro_batches {cfg.micro_batches}"
        )
    if not 0 < cfg.learning_rate < 1:
        problems.append(f"abnet.learning_rate {cfg.learning_rate} must be in (0, 1)")
    if problems:
        raise InvalidRequestError("invalid stage spec: " + "; ".join(problems))
