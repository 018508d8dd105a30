"""Validation of a StageSpec before anything starts: each bad field named."""

from __future__ import annotations

import json
import re

from nebula_common.codec import CodecError
from nebula_common.codec.stream_options import canonical_spec
from nebula_common.errors import InvalidRequestError
from nebula_common.jobspec.spec import sharding_problem
from nebula_common.pretrained import PretrainedError, declared_dirs, dir_problems
from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer.runtime.program import hot_start_problems
from services.trainer.runtime.schedule import SCHEDULES

_DATASET = re.compile(r"^[a-z0-9][a-z0-9._-]{2,63}/[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ROLES = ("upstream", "middle", "downstream")
MODES = ("backprop", "one_way")
PAYLOADS = ("float", "int64")
PARALLEL = ("ddp", "fsdp", "hsdp")
OPTIMIZERS = ("adam", "adamw", "sgd")
LR_SCHEDULES = ("constant", "linear_warmup", "cosine")


def validate_stage_spec(spec: trainer_pb2.StageSpec) -> None:
    """Raise ``InvalidRequestError`` naming every bad field at once, so a submitter fixes them in one go."""
    problems: list[str] = []
    if not _ID.match(spec.job_id):
        problems.append(f"job_id {spec.job_id!r} must be 1-128 chars of [A-Za-z0-9._-]")
    if not _ID.match(spec.stage):
        problems.append(f"stage {spec.stage!r} must be 1-128 chars of [A-Za-z0-9._-]")
    if not spec.edge:
        problems.append("edge is required")
    if not 1 <= spec.steps <= 1_000_000:
        problems.append(f"steps {spec.steps} must be in 1..1000000")
    for name in ("codec_forward", "codec_backward"):
        try:
            if canonical_spec(getattr(spec, name) or "none") == "auto":
                # Both clusters must use the same concrete codec, so advice is taken once, at submission.
                problems.append(
                    f"{name}: 'auto' must be resolved by the submitter (the SDK asks the codec service)"
                )
        except CodecError as exc:
            problems.append(f"{name}: {exc}")
    problems += _program_problems(spec.program)
    problems += _chain_problems(spec)
    problems += hot_start_problems(spec)
    if spec.program.payload == "int64" and (spec.codec_forward or "none") != "none":
        problems.append("codec_forward must be none for an int64 payload (a lossy codec changes ids)")
    if spec.program.mode == "one_way" and (spec.codec_backward or "none") != "none":
        problems.append("codec_backward must be none on a one_way edge (it carries only the sync tensor)")
    if problems:
        raise InvalidRequestError("invalid stage spec: " + "; ".join(problems))


def _pretrained_problems(cfg: trainer_pb2.ProgramStage, options: dict) -> list[str]:
    """The pre-trained directories the module declares, checked in this cluster (config + headers only)."""
    try:
        declared = declared_dirs(cfg.module_source, cfg.module_name or "<stage>")
    except PretrainedError as exc:
        return [f"program.module_source: {exc}"]
    return dir_problems(options, declared, "program.options")


def _chain_problems(spec: trainer_pb2.StageSpec) -> list[str]:
    """A middle stage has a second edge (and trains backprop, on any ``parallel``); no other stage has one."""
    cfg = spec.program
    count = cfg.stage_count or 2
    problems: list[str] = []
    if not 2 <= count <= 8:
        problems.append(f"program.stage_count {cfg.stage_count} must be in 2..8 (0 means 2)")
    elif cfg.stage_index >= count:
        problems.append(f"program.stage_index {cfg.stage_index} must be below stage_count {count}")
    middle = cfg.role == "middle"
    if not middle:
        if spec.HasField("downstream_edge"):
            problems.append("downstream_edge: only a middle stage (program.role middle) has a second edge")
        return problems
    if count < 3:
        problems.append("program.role middle needs a chain: program.stage_count >= 3")
    down = spec.downstream_edge
    if not down.edge:
        problems.append("downstream_edge.edge is required for a middle stage")
    elif down.edge == spec.edge:
        problems.append(f"downstream_edge.edge must differ from edge {spec.edge!r}")
    for name in ("codec_forward", "codec_backward"):
        try:
            if canonical_spec(getattr(down, name) or "none") == "auto":
                problems.append(f"downstream_edge.{name}: 'auto' must be resolved by the submitter")
        except CodecError as exc:
            problems.append(f"downstream_edge.{name}: {exc}")
    if (cfg.mode or "backprop") != "backprop":
        problems.append("program.mode: a middle stage of a chain needs backprop")
    return problems


def _program_problems(cfg: trainer_pb2.ProgramStage) -> list[str]:
    problems: list[str] = []
    if cfg.role not in ROLES:
        problems.append(f"program.role {cfg.role!r} must be one of {', '.join(ROLES)}")
    if not cfg.module_source.strip():
        problems.append("program.module_source is empty")
    else:
        try:
            compile(cfg.module_source, cfg.module_name or "<stage>", "exec")
        except SyntaxError as exc:
            problems.append(f"program.module_source: line {exc.lineno}: syntax error: {exc.msg}")
    try:
        options = json.loads(cfg.options_json or "{}")
        if not isinstance(options, dict):
            problems.append("program.options_json must be a JSON object")
        else:
            problems += _pretrained_problems(cfg, options)
    except ValueError as exc:
        problems.append(f"program.options_json: {exc}")
    if cfg.micro_batches < 1:
        problems.append("program.micro_batches must be >= 1")
    elif cfg.batch_size < cfg.micro_batches or cfg.batch_size % cfg.micro_batches:
        problems.append(
            f"program.batch_size {cfg.batch_size} must be a positive multiple of "
            f"micro_batches {cfg.micro_batches}"
        )
    if cfg.num_examples < 1:
        problems.append("program.num_examples must be >= 1")
    if cfg.schedule not in SCHEDULES:
        problems.append(f"program.schedule {cfg.schedule!r} must be one of {', '.join(SCHEDULES)}")
    if not 1 <= cfg.max_in_flight <= 256:
        problems.append(f"program.max_in_flight {cfg.max_in_flight} must be in 1..256")
    opt = cfg.optimizer
    if opt.name not in OPTIMIZERS:
        problems.append(f"program.optimizer.name {opt.name!r} must be one of {', '.join(OPTIMIZERS)}")
    if not 0 < opt.learning_rate < 10:
        problems.append(f"program.optimizer.learning_rate {opt.learning_rate} must be in (0, 10)")
    if opt.lr_schedule not in LR_SCHEDULES:
        problems.append(
            f"program.optimizer.lr_schedule {opt.lr_schedule!r} must be one of {', '.join(LR_SCHEDULES)}"
        )
    mode = cfg.mode or "backprop"
    if mode not in MODES:
        problems.append(f"program.mode {cfg.mode!r} must be one of {', '.join(MODES)}")
    if cfg.sync_lag > 64:
        problems.append(f"program.sync_lag {cfg.sync_lag} must be in 0..64")
    if cfg.replicas > 64:
        problems.append(f"program.replicas {cfg.replicas} must be in 0..64")
    elif cfg.replicas > 1:
        if cfg.role == "upstream" and (cfg.mode or "backprop") == "one_way":
            # A one_way upstream trains on its own loss, which may sample: replicas would not reproduce it.
            problems.append("program.replicas: a one_way upstream stage runs on one process")
        micro = cfg.batch_size // cfg.micro_batches if cfg.micro_batches else 0
        if micro % cfg.replicas:
            problems.append(f"program.replicas {cfg.replicas} must divide the micro-batch size {micro}")
    parallel = cfg.parallel or "ddp"
    if parallel not in PARALLEL:
        problems.append(f"program.parallel {cfg.parallel!r} must be one of {', '.join(PARALLEL)}")
    else:
        shard = sharding_problem(parallel, max(cfg.replicas, 1), cfg.shard_size or None)
        if shard is not None:
            problems.append(f"program.{shard}")
        if parallel != "ddp" and cfg.initial_state:
            problems.append(
                "program.initial_state: a hot start into a sharded (fsdp/hsdp) stage is not supported; "
                "use parallel ddp for the hot-started run"
            )
    payload = cfg.payload or "float"
    if payload not in PAYLOADS:
        problems.append(f"program.payload {cfg.payload!r} must be one of {', '.join(PAYLOADS)}")
    elif payload == "int64" and mode != "one_way":
        problems.append("program.payload int64 needs program.mode one_way (ids carry no gradient)")
    if cfg.dataset:
        if not _DATASET.match(cfg.dataset):
            problems.append(f"program.dataset {cfg.dataset!r} must be OWNER/NAME")
        if cfg.replicas > 1:
            # Replicas would each need the grant; one reader keeps every batch read audited once.
            problems.append("program.dataset: a stage that trains on a granted dataset runs on one process")
    if cfg.resume_job_id and not _ID.match(cfg.resume_job_id):
        problems.append(f"program.resume_job_id {cfg.resume_job_id!r} must be 1-128 chars of [A-Za-z0-9._-]")
    return problems
