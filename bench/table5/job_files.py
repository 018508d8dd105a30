"""The Table 5 fine-tuning as a Nebula job (``job/``): the files each cluster's stage reads and the spec.

Shared by ``product.py``, which places the files in each account's directory of two real clusters, and
``advisor.py``, which places them in one scratch folder to let the product's ``codec: auto`` decide in
this process. Both therefore run the same job: the prepared halves, the training split's token ids and,
for a calibrated bottleneck row, the halves its autoencoder pre-training left; a co-trained row's stages
load that row's own halves and bottleneck (``cotrain.py``).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train

from nebula_common.zoo.bottleneck import save_halves

JOB = Path(__file__).resolve().parent / "job" / "job.yaml"
STAGES = (("a", "encoder.pt", "es.pt"), ("b", "decoder.pt", "en.pt"))
"""Per stage of the job, in its order: its cluster, its half's weights file, its side's token ids file."""


def stage_files(prep: train.Prepared, rows: list[train.Row]) -> dict[str, dict[str, Any]]:
    """What each cluster holds: its half, its side's token ids, each calibrated bottleneck's halves.

    The halves are the prepared translation model's; a quick run prepares none (its LMs are barely
    pre-trained and never translate), so there they are the adapter-wrapped LMs fine-tuning starts from.
    """
    state = prep.translation_state or _starting_halves(prep)
    files: dict[str, dict[str, Any]] = {
        "a": {"encoder.pt": state["encoder"], "es.pt": prep.train_es},
        "b": {"decoder.pt": state["decoder"], "en.pt": prep.train_en},
    }
    for row in rows:
        if row.cut_cotrain:  # halves trained with the bottleneck (cotrain.py): their own weights and cut_init
            state = prep.cut_states[train.cut_key(row)]
            for cluster, weights, _ in STAGES:
                files[cluster][_weights_file(row, weights)] = state[weights.removesuffix(".pt")]
                if row.cut_k:
                    files[cluster][_cut_file(row)] = {"down": state["down"], "up": state["up"]}
        elif row.cut_pretrain:  # the product's calibrate + cut_init, from the benchmark's own calibration
            stages = train.Stages(prep, row, seed=0)
            with tempfile.TemporaryDirectory() as scratch:
                path = Path(scratch) / "halves.pt"
                save_halves(str(path), stages.down, stages.up)
                halves = torch.load(path, weights_only=True)
            for cluster in files:
                files[cluster][_cut_file(row)] = halves
    return files


def _weights_file(row: train.Row, weights: str) -> str:
    """A stage's weights file for ``row``: the shared halves, or a co-trained row's own."""
    return f"{weights.removesuffix('.pt')}-{train.cut_key(row)}.pt" if row.cut_cotrain else weights


def _cut_file(row: train.Row) -> str:
    """The bottleneck halves file (``cut_init``) of a calibrated or co-trained row."""
    return f"cut-{train.cut_key(row)}.pt" if row.cut_cotrain else f"cut-{row.cut_k}.pt"


def _starting_halves(prep: train.Prepared) -> dict[str, dict[str, torch.Tensor]]:
    stages = train.Stages(prep, train.Row("none"), seed=0)
    return {"encoder": stages.encoder.state_dict(), "decoder": stages.decoder.state_dict()}


def place(folder: Path, files: dict[str, Any], owner: os.stat_result | None = None) -> dict[str, str]:
    """Save each of ``files`` into ``folder`` (owned like ``owner`` when given); their paths by name."""
    placed = {}
    for name, value in files.items():
        path = folder / name
        torch.save(value, path)
        if owner is not None:
            os.chown(path, owner.st_uid, owner.st_gid)
        placed[name] = str(path)
    return placed


def job_overrides(
    row: train.Row, placed: dict[str, dict[str, str]], *, steps: int, micro_batches: int, examples: int
) -> dict[str, Any]:
    """The job spec's overrides (``load_spec(JOB, ...)``) that run ``row`` on the placed files."""
    overrides: dict[str, Any] = {
        "steps": steps,
        "data.micro_batches": micro_batches,
        "data.examples": examples,
        "edges.0.codec.forward": row.forward,
        "edges.0.codec.backward": row.backward,
    }
    for index, (cluster, weights, ids) in enumerate(STAGES):
        stage = f"stages.{index}.options"
        overrides |= {
            f"{stage}.weights": placed[cluster][_weights_file(row, weights)],
            f"{stage}.examples": placed[cluster][ids],
        }
        if row.cut_k:
            overrides |= {f"{stage}.cut_k": row.cut_k}
        if row.cut_k and (row.cut_pretrain or row.cut_cotrain):
            overrides |= {
                f"{stage}.cut_init": placed[cluster][_cut_file(row)],
                f"{stage}.cut_residual": row.down_residual,
            }
    return overrides
