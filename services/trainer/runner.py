"""Runs one ABNet stage: the training loop on its own thread, talking to the edge.

Schedule per optimizer step with M micro-batches (GPipe-style across the
cluster boundary): the encoder runs all M forwards and queues each activation
as soon as it is computed, so transfers of micro-batch i overlap the compute
of i+1; the decoder consumes activations in order and returns each gradient
at once; the encoder then applies the gradients and both sides step.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
from torch import nn

from nebula_common.codec import TensorStreamDecoder, TensorStreamEncoder
from nebula_common.proto.nebula.v1 import tensor_pb2, trainer_pb2
from services.trainer.edge import EdgeClosedError, EdgeConnection
from services.trainer.metrics import LOSS, STEP_SECONDS, STEPS_TOTAL, WAIT_SECONDS
from services.trainer.scenarios.abnet import DecoderStage, build_stage
from services.trainer.scenarios.numbers import SourceShard, TargetShard, example_ids
from services.trainer.status import StatusBoard

FORWARD = tensor_pb2.DIRECTION_FORWARD
BACKWARD = tensor_pb2.DIRECTION_BACKWARD
log = logging.getLogger(__name__)


class StageCancelled(Exception):
    pass


class StageRunner:
    def __init__(self, spec: trainer_pb2.StageSpec, token: str, switch_address: str) -> None:
        self.spec = spec
        self.token = token
        self.switch_address = switch_address
        self.board = StatusBoard(spec.job_id, spec.stage)
        self._cancelled = threading.Event()
        self._edge: EdgeConnection | None = None
        self._thread = threading.Thread(target=self._run, name=f"stage-{spec.job_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def cancel(self) -> None:
        """Stop at once, even while blocked waiting for the other cluster."""
        self._cancelled.set()
        if self._edge is not None:
            self._edge.abort("cancelled")

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        spec = self.spec
        edge: EdgeConnection | None = None
        try:
            cfg = spec.abnet
            model = build_stage(spec.stage, cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.seed)
            optimizer = torch.optim.Adam(model.parameters(), lr=cfg.learning_rate)
            # The encoder stage sends forward and receives backward; the decoder the reverse.
            self._forward_encoder = TensorStreamEncoder(spec.codec_forward or "none")
            self._forward_decoder = TensorStreamDecoder(spec.codec_forward or "none")
            self._backward_encoder = TensorStreamEncoder(spec.codec_backward or "none")
            self._backward_decoder = TensorStreamDecoder(spec.codec_backward or "none")
            edge = EdgeConnection(self.switch_address, self.token, spec.job_id, spec.edge)
            self._edge = edge
            if self._cancelled.is_set():
                raise StageCancelled
            self.board.update(state=trainer_pb2.STAGE_STATE_RUNNING)
            log.info("stage running", extra={"fields": {"job_id": spec.job_id, "stage": spec.stage}})
            step_fn = self._encoder_step if spec.stage == "encoder" else self._decoder_step
            shard = SourceShard() if spec.stage == "encoder" else TargetShard()
            for step in range(spec.steps):
                if self._cancelled.is_set():
                    raise StageCancelled
                started = time.perf_counter()
                wait_before = edge.stats.wait_seconds
                loss = step_fn(model, optimizer, edge, shard, step)
                elapsed = time.perf_counter() - started
                waited = edge.stats.wait_seconds - wait_before
                self._report_step(step, elapsed, waited, loss, edge)
            edge.close("finished")
            self.board.update(state=trainer_pb2.STAGE_STATE_SUCCEEDED)
        except StageCancelled:
            if edge is not None:
                edge.abort("cancelled")
            self.board.update(state=trainer_pb2.STAGE_STATE_CANCELLED, message="cancelled")
        except EdgeClosedError as exc:
            if self._cancelled.is_set():
                self.board.update(state=trainer_pb2.STAGE_STATE_CANCELLED, message="cancelled")
                return
            log.error("stage failed: %s", exc)
            if edge is not None:
                edge.abort(str(exc))
            self.board.update(state=trainer_pb2.STAGE_STATE_FAILED, message=str(exc))
        except Exception as exc:
            log.exception("stage crashed")
            if edge is not None:
                edge.abort(f"{type(exc).__name__}: {exc}")
            self.board.update(state=trainer_pb2.STAGE_STATE_FAILED, message=f"{type(exc).__name__}: {exc}")

    def _report_step(
        self,
        step: int,
        elapsed: float,
        waited: float,
        loss: float | None,
        edge: EdgeConnection,
        **extra: object,
    ) -> None:
        labels = (self.spec.job_id, self.spec.stage)
        STEP_SECONDS.labels(*labels).observe(elapsed)
        WAIT_SECONDS.labels(*labels).inc(waited)
        STEPS_TOTAL.labels(*labels).inc()
        fields: dict[str, object] = dict(
            steps_done=step + 1,
            step_seconds=elapsed,
            wait_seconds=waited,
            bytes_sent=edge.stats.bytes_sent,
            bytes_received=edge.stats.bytes_received,
            raw_bytes_sent=edge.stats.raw_bytes_sent,
            raw_bytes_received=edge.stats.raw_bytes_received,
            **extra,
        )
        if loss is not None:
            LOSS.labels(*labels).set(loss)
            fields["loss"] = loss
        self.board.update(**fields)

    def _micro_batch_size(self) -> int:
        cfg = self.spec.abnet
        return cfg.batch_size // cfg.micro_batches

    def _ids(self, step: int, micro_batch: int) -> torch.Tensor:
        cfg = self.spec.abnet
        return example_ids(cfg.seed, step, micro_batch, cfg.micro_batches, self._micro_batch_size())

    def _encoder_step(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        edge: EdgeConnection,
        shard: SourceShard,
        step: int,
    ) -> None:
        micro_batches = self.spec.abnet.micro_batches
        optimizer.zero_grad(set_to_none=True)
        outputs = []
        for mb in range(micro_batches):
            ids = self._ids(step, mb)
            states = model(shard.batch(ids))
            edge.send(states, self._forward_encoder, FORWARD, step, mb, ids.tolist())
            outputs.append(states)
        for mb in range(micro_batches):
            grad = edge.receive(self._backward_decoder, BACKWARD, step, mb)
            if grad.shape != outputs[mb].shape:
                raise EdgeClosedError(
                    f"gradient shape {tuple(grad.shape)} != activation {tuple(outputs[mb].shape)}"
                )
            outputs[mb].backward(grad.to(outputs[mb].dtype))
        optimizer.step()
        return None

    def _decoder_step(
        self,
        model: DecoderStage,
        optimizer: torch.optim.Optimizer,
        edge: EdgeConnection,
        shard: TargetShard,
        step: int,
    ) -> float:
        micro_batches = self.spec.abnet.micro_batches
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for mb in range(micro_batches):
            ids = self._ids(step, mb)
            memory = edge.receive(self._forward_decoder, FORWARD, step, mb, ids.tolist()).requires_grad_(True)
            loss = model.loss(memory, shard.batch(ids)) / micro_batches
            loss.backward()
            edge.send(memory.grad, self._backward_encoder, BACKWARD, step, mb, ids.tolist())
            total += loss.item()
        optimizer.step()
        return total
