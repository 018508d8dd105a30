"""Middle stages of a chain (stage 0 -> 1 -> ... -> N-1 across N clusters): two edges, one stage.

A middle stage receives activations on its upstream edge and sends its output down the
other; it receives that output's gradient from below and sends the gradient of what it
received back up. Each edge is an ordinary edge end (``EdgeConnection``), opened through
the same ``EdgeFactory`` as any stage's: ``edge_views`` turns the middle's spec into the
two specs an end stage would have (the upstream edge seen as its downstream end, the
downstream edge as its upstream end), so transports, codecs, epochs and the switch's
routing (``EdgeOpen.peer_cluster``) are exactly those of a two-stage job.

Schedule: the middle runs the first stage's op list (``upstream_ops``): F = receive the
micro-batch from above, compute, send below; B = receive its gradient from below,
backpropagate, send the input's gradient above. Every edge then carries its items in the
order both of its ends expect (GPipe and 1F1B alike), and no stage waits on an item that
waits on it.

Failures: the two edges of one attempt live and die together (``FailureRelay``). When one
ends because the attempt is lost (a neighbour restarted, an outage) the other is shut
without telling its peer, which learns of the new epoch from the middle's first item of
it; when one ends because a neighbour failed (or this stage failed or was cancelled), the other
is failed with the same reason, so the failure (or the cancel) travels the whole chain at
once instead of waiting out a receive timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

import torch

from nebula_common.jobspec.runtime import ProgramError, StageProgram
from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer.edge import (
    EdgeClosedError,
    EdgeConnection,
    EdgeOutage,
    EdgeRestartRequired,
    EdgeStats,
    renewed,
)
from services.trainer.runtime.program import micro_batch_ids
from services.trainer.runtime.schedule import upstream_ops
from services.trainer.runtime.transfer import AsyncSender, ReceiveAhead

PEER_FAILED = "peer side failed: "
"""How the edge session words a neighbour's error close (``session.py``); passed on without it."""


def edge_views(spec: trainer_pb2.StageSpec) -> tuple[trainer_pb2.StageSpec, trainer_pb2.StageSpec]:
    """A middle stage's (upstream edge, downstream edge) as the stage specs an ``EdgeFactory`` opens."""
    up = trainer_pb2.StageSpec()
    up.CopyFrom(spec)
    up.ClearField("downstream_edge")
    up.program.role = "downstream"  # on its upstream edge the middle is the receiving end
    down = trainer_pb2.StageSpec()
    down.CopyFrom(up)
    chained = spec.downstream_edge
    down.edge = chained.edge
    down.codec_forward = chained.codec_forward
    down.codec_backward = chained.codec_backward
    down.peer_cluster = chained.peer_cluster
    down.program.role = "upstream"
    return up, down


def combined_stats(edges: list[EdgeConnection]) -> EdgeStats:
    """Bytes of every edge of the stage, for its status (a middle reports both of its edges)."""
    if len(edges) == 1:
        return edges[0].stats
    total = EdgeStats()
    for edge in edges:
        total.bytes_sent += edge.stats.bytes_sent
        total.bytes_received += edge.stats.bytes_received
        total.raw_bytes_sent += edge.stats.raw_bytes_sent
        total.raw_bytes_received += edge.stats.raw_bytes_received
        total.frames_sent += edge.stats.frames_sent
        total.frames_received += edge.stats.frames_received
        total.wait_seconds += edge.stats.wait_seconds
    return total


def edge_traffic(edges: list[EdgeConnection]) -> list[trainer_pb2.EdgeTraffic]:
    """Each edge's own counters for the stage's status (a chain's summary reads them per edge)."""
    return [
        trainer_pb2.EdgeTraffic(
            edge=edge.edge,
            bytes_sent=edge.stats.bytes_sent,
            raw_bytes_sent=edge.stats.raw_bytes_sent,
            frames_sent=edge.stats.frames_sent,
            bytes_received=edge.stats.bytes_received,
            raw_bytes_received=edge.stats.raw_bytes_received,
            frames_received=edge.stats.frames_received,
        )
        for edge in edges
    ]


class FailureRelay:
    """Ends a middle stage's other edge as soon as one of its two edges ends (see the module doc)."""

    POLL_S = 0.05

    def __init__(self, edges: tuple[EdgeConnection, EdgeConnection]) -> None:
        self.edges = edges
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"chain-{edges[0].edge}", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.POLL_S):
            for ended, other in (self.edges, self.edges[::-1]):
                if self._relay(ended, other):
                    return

    def _relay(self, ended: EdgeConnection, other: EdgeConnection) -> bool:
        failure = ended.session.failure
        peer = ended.session.peer_failure
        if failure is None and peer is None:
            return False
        if other.session.failure is None and not self._stop.is_set():
            if isinstance(failure, EdgeRestartRequired | EdgeOutage):
                # The attempt is lost: the other neighbour learns of the next epoch from our next item.
                other.session.fail(f"{ended.edge}: {failure}", tell_peer=False, error=renewed(failure))
            else:  # the same reason on: a cancel stays a cancel, a neighbour's error reaches the far end
                reason = str(failure) if failure is not None else str(peer).removeprefix(PEER_FAILED)
                other.session.fail(reason)
        return True

    def stop(self) -> None:
        """Stop watching (before the stage closes its edges in order: a finished edge is no failure)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5)


class MiddleCompute(Protocol):
    """What a middle stage computes per micro-batch: in this process, or on its data-parallel ranks."""

    def relay(self, step: int, micro_batch: int, received: torch.Tensor, ids: list[int]) -> torch.Tensor:
        """The output to send below for what arrived from above."""
        ...

    def relay_backward(self, step: int, micro_batch: int, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of what arrived from above, given the gradient of the output from below."""
        ...


class LocalMiddle:
    """A middle stage on one process: the stage thread relays and backpropagates itself."""

    def __init__(self, program: StageProgram) -> None:
        self.program = program
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def relay(self, step: int, micro_batch: int, received: torch.Tensor, ids: list[int]) -> torch.Tensor:
        received = received.requires_grad_(True)
        out = self.program.relay(received, ids)
        self._pending[micro_batch] = (received, out)
        return out

    def relay_backward(self, step: int, micro_batch: int, grad: torch.Tensor) -> torch.Tensor:
        received, out = self._pending.pop(micro_batch)
        if grad.shape != out.shape:
            raise EdgeClosedError(f"gradient shape {tuple(grad.shape)} != activation {tuple(out.shape)}")
        out.backward(grad.to(out.dtype))
        if received.grad is None:
            raise ProgramError(
                "the middle stage's output does not depend on what it received: no gradient to send up"
            )
        return received.grad


class MiddleStep:
    """One attempt's optimizer steps through a middle stage (the schedule in the module doc).

    ``compute``: ``LocalMiddle`` on one process, or the stage's ``DataParallelGroup`` on n ranks
    (rank 0, the stage thread, holds both edges; each rank relays its rows of every micro-batch).
    ``finish(step)`` steps the optimizer (the stage's, or its ranks' together).
    """

    def __init__(
        self,
        compute: MiddleCompute,
        cfg: trainer_pb2.ProgramStage,
        finish: Callable[[int], None],
        *,
        from_above: ReceiveAhead,
        to_above: AsyncSender,
        from_below: ReceiveAhead,
        to_below: AsyncSender,
    ) -> None:
        self.compute = compute
        self.cfg = cfg
        self.finish = finish
        self.ops = upstream_ops(cfg.schedule, cfg.micro_batches, cfg.max_in_flight)
        self.from_above, self.to_above = from_above, to_above
        self.from_below, self.to_below = from_below, to_below

    def run(self, step: int) -> tuple[float | None, dict[str, object]]:
        """One step's micro-batches both ways, then the optimizer step (a middle owns no loss)."""
        # each micro-batch's example ids (the same in every cluster)
        ids_of = {mb: micro_batch_ids(self.cfg, step, mb) for mb in range(self.cfg.micro_batches)}
        for op in self.ops:  # what each edge will deliver, in the order the ops take it
            source = self.from_above if op.kind == "F" else self.from_below
            source.expect_tensor(step, op.micro_batch, ids_of[op.micro_batch])
        for op in self.ops:
            mb, ids = op.micro_batch, ids_of[op.micro_batch]
            if op.kind == "F":
                out = self.compute.relay(step, mb, self.from_above.tensor(step, mb), ids)
                self.to_below.send(out, step, mb, ids)
                continue
            grad = self.compute.relay_backward(step, mb, self.from_below.tensor(step, mb))
            self.to_above.send(grad, step, mb, ids)
        self.finish(step)  # the ranks sum their gradients and step together
        return None, {}


__all__ = [
    "FailureRelay",
    "LocalMiddle",
    "MiddleCompute",
    "MiddleStep",
    "combined_stats",
    "edge_traffic",
    "edge_views",
]
