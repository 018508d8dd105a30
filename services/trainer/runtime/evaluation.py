"""Held-out evaluation after a two-stage backprop job's last step, across the same edge.

Why a module of its own: evaluation is no step (no gradient, no optimizer, no checkpoint) and has
its own protocol on the edge: the upstream sends each eval batch's output once, the downstream
decodes and scores where its references live and answers with EVAL_DONE.
"""

from __future__ import annotations

import json
import logging
import time

import torch

from nebula_common.jobspec.runtime import ProgramError, StageProgram
from nebula_common.proto.nebula.v1 import relay_pb2, trainer_pb2
from services.trainer.edge import EdgeClosedError
from services.trainer.runtime.checkpoint import CheckpointStore
from services.trainer.runtime.transfer import AsyncSender, ReceiveAhead

log = logging.getLogger(__name__)
EVAL_DONE = relay_pb2.SIGNAL_KIND_EVAL_DONE


def evaluates(spec: trainer_pb2.StageSpec, program: StageProgram) -> bool:
    """Whether the stage evaluates after its last step: a two-stage backprop job whose module defines it."""
    cfg = spec.program
    defined = callable(getattr(program.module, "load_eval_examples", None))
    return cfg.mode != "one_way" and defined and not (cfg.stage_count or 2) > 2


def evaluate(
    spec: trainer_pb2.StageSpec,
    program: StageProgram,
    receiver: ReceiveAhead,
    sender: AsyncSender,
    upstream: bool,
    store: CheckpointStore,
    owner: str,
) -> None:
    """Held-out evaluation after the last step (backprop jobs whose modules define it).

    Both modules define ``load_eval_examples(options)``; the downstream one also
    ``decode(model, received, batch) -> list[str]`` and ``score(outputs, examples) -> dict``.
    The upstream stage sends each eval batch's output once (frames of step ``steps``,
    micro-batch = batch index, example ids after the training ids), with no gradient
    back; the downstream decodes each (e.g. greedy, autoregressively, all locally),
    scores where its references live, writes ``eval.json`` into its own job directory
    (in ``owner``'s part of ``store``), and sends an EVAL_DONE signal with the batch count
    so the upstream knows it finished.
    """
    cfg, module = spec.program, program.module
    if not upstream and not (callable(getattr(module, "decode", None)) and callable(module.score)):
        raise ProgramError("an evaluating downstream module must define decode() and score()")
    started = time.perf_counter()
    examples = module.load_eval_examples(program.options)
    size = cfg.batch_size // cfg.micro_batches
    step = spec.steps
    outputs: list[str] = []
    batches = 0
    starts = range(0, len(examples), size)
    if not upstream:  # decoded ahead while the previous batch decodes its outputs
        for index, first in enumerate(starts):
            count = len(examples[first : first + size])
            receiver.expect_tensor(
                step, index, range(cfg.num_examples + first, cfg.num_examples + first + count)
            )
    program.model.eval()
    with torch.no_grad():
        for batches, first in enumerate(starts, start=1):
            chunk = examples[first : first + size]
            ids = list(range(cfg.num_examples + first, cfg.num_examples + first + len(chunk)))
            if upstream:
                out = program.forward(module.collate(chunk))
                sender.send(out, step, batches - 1, ids)
                continue
            received = receiver.tensor(step, batches - 1)
            decoded = module.decode(program.model, received, module.collate(chunk))
            if not (isinstance(decoded, list) and len(decoded) == len(chunk)):
                raise ProgramError(f"decode() must return a list of {len(chunk)} outputs")
            outputs.extend(str(text) for text in decoded)
    if upstream:
        receiver.expect_signal(EVAL_DONE, step)
        done = receiver.signal(EVAL_DONE, step)
        if len(done) != 1 or done[0] != batches:
            raise EdgeClosedError(f"eval mismatch: sent {batches} batches, peer reports {done}")
        return
    metrics = module.score(outputs, examples)
    record = {
        "job_id": spec.job_id,
        "stage": spec.stage,
        "examples": len(examples),
        "batches": batches,
        "eval_seconds": time.perf_counter() - started,
        "metrics": {name: float(value) for name, value in dict(metrics).items()},
        "outputs": outputs,
    }
    directory = store.stage_dir(owner, spec.job_id, spec.stage)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "eval.json").write_text(json.dumps(record, indent=1, ensure_ascii=False))
    log.info("evaluation done", extra={"fields": {"job_id": spec.job_id, **record["metrics"]}})
    sender.send_signal(EVAL_DONE, step, [float(batches)])


__all__ = ["EVAL_DONE", "evaluate", "evaluates"]
