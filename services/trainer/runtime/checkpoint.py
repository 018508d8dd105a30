"""Per-stage checkpoints as plain torch state dicts, written atomically at step boundaries.

Layout under the trainer's data dir::

    accounts/<owner>/jobs/<job_id>/<stage>/step-<n>/
        model.pt      model.state_dict()   (torch.load it, no Nebula needed)
        optimizer.pt  optimizer.state_dict()
        scheduler.pt  LR scheduler state_dict()
        meta.json     {"step": n, "owner": ..., "job_id": ..., "stage": ...}

A sharded (fsdp/hsdp) stage writes ``dcp/`` (``torch.distributed.checkpoint``: every rank's
shards plus a metadata file; ``torch.distributed.checkpoint.load`` reads it back into any number of
ranks, or into one plain process) instead of ``model.pt`` and ``optimizer.pt``, and meta.json says
``"format": "dcp"``. Every rank writes into the same temporary directory (the data dir is shared by
the stage's ranks: one host, or one volume), and rank 0 renames it once all ranks wrote.

``step-<n>`` means "after n completed optimizer steps". A directory appears
only complete (written to a temporary name, then renamed), so a crash never
leaves a checkpoint that looks whole but is not. Both clusters checkpoint at the
same step numbers; a resume picks a step every cluster holds.

Checkpoints live in their owner's namespace: another account cannot list, load,
overwrite or prune them even by reusing the same job id, because every lookup
starts from the caller's own directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from nebula_common.jobspec.runtime import StageProgram
from services.trainer.runtime.sharding import ShardingError, holds_dtensors, load_sharded

_STEP_DIR = re.compile(r"^step-(\d+)$")
KEEP = 3


class CheckpointError(RuntimeError):
    pass


@dataclass(frozen=True)
class CheckpointStore:
    root: Path

    def stage_dir(self, owner: str, job_id: str, stage: str) -> Path:
        for part, value in (("owner", owner), ("job_id", job_id), ("stage", stage)):
            if not value or "/" in value or value.startswith("."):
                raise CheckpointError(f"invalid {part} {value!r} for a checkpoint path")
        return self.root / "accounts" / owner / "jobs" / job_id / stage

    def steps(self, owner: str, job_id: str, stage: str) -> list[int]:
        """Completed checkpoint steps of ``owner``'s job stage (empty for anyone else's)."""
        directory = self.stage_dir(owner, job_id, stage)
        if not directory.is_dir():
            return []
        found = (_STEP_DIR.match(p.name) for p in directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m and (directory / m.group(0) / "meta.json").exists())

    def discard_after(self, owner: str, job_id: str, stage: str, step: int) -> None:
        """Delete the checkpoints of steps after ``step``: a recovery that restarts from ``step`` voids them,
        and a later recovery must not pick one of them."""
        directory = self.stage_dir(owner, job_id, stage)
        for later in self.steps(owner, job_id, stage):
            if later > step:
                shutil.rmtree(directory / f"step-{later}", ignore_errors=True)

    def save(self, job_id: str, stage: str, owner: str, step: int, program: StageProgram) -> Path:
        directory = self.stage_dir(owner, job_id, stage)
        directory.mkdir(parents=True, exist_ok=True)
        final = directory / f"step-{step}"
        partial = directory / f".step-{step}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        torch.save(program.model.state_dict(), partial / "model.pt")
        torch.save(program.optimizer.state_dict(), partial / "optimizer.pt")
        torch.save(program.scheduler.state_dict(), partial / "scheduler.pt")
        meta = {"step": step, "owner": owner, "job_id": job_id, "stage": stage}
        (partial / "meta.json").write_text(json.dumps(meta))
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
        for old in self.steps(owner, job_id, stage)[:-KEEP]:
            shutil.rmtree(directory / f"step-{old}", ignore_errors=True)
        return final

    def sharded_partial(self, owner: str, job_id: str, stage: str, step: int) -> Path:
        """Where every rank of a sharded stage writes step ``step`` before rank 0 publishes it."""
        return self.stage_dir(owner, job_id, stage) / f".step-{step}.partial-sharded"

    def save_sharded(
        self, job_id: str, stage: str, owner: str, step: int, write: Callable[[Path], None]
    ) -> Path:
        """Publish a sharded checkpoint: ``write(directory)`` has every rank write its part there."""
        directory = self.stage_dir(owner, job_id, stage)
        directory.mkdir(parents=True, exist_ok=True)
        final = directory / f"step-{step}"
        partial = self.sharded_partial(owner, job_id, stage, step)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        write(partial)
        meta = {"step": step, "owner": owner, "job_id": job_id, "stage": stage, "format": "dcp"}
        (partial / "meta.json").write_text(json.dumps(meta))
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
        for old in self.steps(owner, job_id, stage)[:-KEEP]:
            shutil.rmtree(directory / f"step-{old}", ignore_errors=True)
        return final

    def load(self, job_id: str, stage: str, step: int, owner: str, program: StageProgram) -> None:
        directory = self.stage_dir(owner, job_id, stage) / f"step-{step}"
        if not (directory / "meta.json").exists():
            held = self.steps(owner, job_id, stage)
            raise CheckpointError(
                f"no checkpoint of job {job_id!r} stage {stage!r} at step {step} on this cluster "
                f"(held: {held or 'none'})"
            )
        meta = json.loads((directory / "meta.json").read_text())
        if meta.get("owner") != owner:
            raise CheckpointError(f"no checkpoint of job {job_id!r} stage {stage!r} for this account")
        sharded_model = holds_dtensors(program.model)
        if meta.get("format") == "dcp":  # resharded to this stage's ranks, or whole into one process
            try:
                load_sharded(directory / "dcp", program)
            except ShardingError as exc:
                raise CheckpointError(f"job {job_id!r} stage {stage!r} step {step}: {exc}") from exc
            program.scheduler.load_state_dict(torch.load(directory / "scheduler.pt", weights_only=True))
            return
        if sharded_model:
            raise CheckpointError(
                f"checkpoint step-{step} of job {job_id!r} stage {stage!r} was written by an unsharded "
                "stage (model.pt); resume it with parallel: ddp"
            )
        program.model.load_state_dict(torch.load(directory / "model.pt", weights_only=True))
        program.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=True))
        program.scheduler.load_state_dict(torch.load(directory / "scheduler.pt", weights_only=True))
