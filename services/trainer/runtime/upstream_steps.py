"""The first stage of a backprop job, one optimizer step at a time: its schedule and 1F1B's window.

The upstream stage runs its schedule's forwards and backwards (GPipe or 1F1B), sending each
activation through the async sender and applying the gradients in micro-batch order as they
return. Why a module of its own: the window a 1F1B upstream holds in flight is sized per step from
what the step measured, and that measuring is this role's alone (the downstream and a chain's middle
only follow the order the upstream's schedule gives the edge).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from nebula_common.jobspec.runtime import StageProgram
from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer.edge import EdgeClosedError
from services.trainer.runtime.parallel import DataParallelGroup
from services.trainer.runtime.program import micro_batch_ids
from services.trainer.runtime.rank_group import RankGroup
from services.trainer.runtime.schedule import covering_window, upstream_ops
from services.trainer.runtime.transfer import AsyncSender, ReceiveAhead

log = logging.getLogger(__name__)


class UpstreamSteps:
    """One attempt's steps of a backprop upstream stage (not a chain's middle: ``chain.MiddleStep``).

    ``finish(step)`` steps the optimizer (the stage's, or its ranks' together). ``windows`` and
    ``window_inputs`` are the runner's lists of this attempt, appended to per step: the activations
    in flight, and (gradient latency s, compute per micro-batch s) of each step that sized the next window.
    """

    def __init__(
        self,
        spec: trainer_pb2.StageSpec,
        program: StageProgram,
        group: DataParallelGroup | RankGroup | None,
        receiver: ReceiveAhead,
        sender: AsyncSender,
        finish: Callable[[int], None],
        *,
        windows: list[int],
        window_inputs: list[tuple[float, float]],
    ) -> None:
        self.spec = spec
        self.program = program
        self.group = group
        self.receiver = receiver
        self.sender = sender
        self.finish = finish
        self.windows = windows
        self.window_inputs = window_inputs
        self._window: int | None = None

    def run(self, step: int) -> tuple[float | None, dict[str, object]]:
        """One step: the schedule's forwards and backwards, then the optimizer step (no loss here)."""
        self._schedule(step)
        self.finish(step)
        return None, {}

    def _schedule(self, step: int) -> None:
        cfg, program, group = self.spec.program, self.program, self.group
        receiver, sender = self.receiver, self.sender
        outputs: dict[int, torch.Tensor] = {}
        # 1F1B's window: the job's max_in_flight (the memory allowed) until a step has measured
        # what covers the gradients' round trip, then that (see covering_window). Only when and
        # how many forwards run ahead changes, never what is computed: training is bit-identical.
        window = min(cfg.max_in_flight, cfg.micro_batches) if self._window is None else self._window
        self.windows.append(window)
        ops = upstream_ops(cfg.schedule, cfg.micro_batches, window)
        for op in ops:  # the gradients, in the order the schedule applies them, decoded as they come
            if op.kind == "B":
                receiver.expect_tensor(step, op.micro_batch, micro_batch_ids(cfg, step, op.micro_batch))
        sent_at: dict[int, float] = {}
        computing = 0.0
        for op in ops:
            if op.kind == "F":
                ids = micro_batch_ids(cfg, step, op.micro_batch)
                started = time.perf_counter()
                if group is not None:  # every rank runs its rows; rank 0 sends them gathered
                    out = group.forward(step, op.micro_batch, ids)
                else:
                    outputs[op.micro_batch] = out = program.forward(program.batch(ids))
                sent_at[op.micro_batch] = time.perf_counter()
                computing += sent_at[op.micro_batch] - started
                sender.send(out, step, op.micro_batch, ids)
            else:
                grad = receiver.tensor(step, op.micro_batch)
                started = time.perf_counter()
                if group is not None:  # each rank backpropagates the rows it produced
                    group.backward(step, op.micro_batch, grad)
                    computing += time.perf_counter() - started
                    continue
                out = outputs.pop(op.micro_batch)
                if grad.shape != out.shape:
                    raise EdgeClosedError(
                        f"gradient shape {tuple(grad.shape)} != activation {tuple(out.shape)}"
                    )
                out.backward(grad.to(out.dtype))
                computing += time.perf_counter() - started
        if cfg.schedule == "1f1b":
            self._size_window(step, sent_at, computing / cfg.micro_batches)

    def _size_window(self, step: int, sent_at: dict[int, float], compute_s: float) -> None:
        """The next step's 1F1B window from this step's measured gradient latency and compute.

        Latency per micro-batch = its gradient decoded and ready (the receive thread's clock)
        minus its activation handed to the sender; the smallest of the step is the one the
        downstream did not queue behind others (the round trip itself). On the serial path
        (no receive thread) a gradient's arrival is not seen apart from when the stage took it,
        which would only ever grow the window: the window stays at ``max_in_flight`` there.
        """
        arrived = self.receiver.arrivals(step)
        latencies = [arrived[mb] - sent for mb, sent in sent_at.items() if mb in arrived]
        if not latencies:
            return
        cfg = self.spec.program
        latency = max(min(latencies), 0.0)
        self.window_inputs.append((latency, compute_s))
        window = covering_window(latency, compute_s, cfg.max_in_flight, cfg.micro_batches)
        if window != self._window:
            log.info(
                "1f1b window sized",
                extra={
                    "fields": {
                        "job_id": self.spec.job_id,
                        "stage": self.spec.stage,
                        "step": step,
                        "window": window,
                        "gradient_latency_ms": round(1000 * latency, 1),
                        "compute_per_micro_batch_ms": round(1000 * compute_s, 1),
                    }
                },
            )
        self._window = window


__all__ = ["UpstreamSteps"]
