"""One stage of a user program on this trainer: its attempts, and the step loop of each.

Every role's step (``role_steps``: the upstream's schedule and 1F1B window, the loss-owning
downstream, a chain's middle, one_way's generator and its SYNC pace) ends with an optimizer
step; both sides step at the same step boundaries, and checkpoint there. This module is the
attempt around those steps: the edges open first (``stage_edges``), then the stage is built,
placed (``stage_placement``) and started at the barrier; each step is timed, checkpointed and
reported (``stage_reports``); a two-stage backprop job evaluates after its last step (``evaluation``).

Recovery (relay.proto, "Epochs"). Each attempt of the stage runs in an epoch of its
edge (0 for a fresh job). When the edge ends with ``EdgeRestartRequired`` (the other
cluster's stage restarted, or gave up an attempt) or ``EdgeOutage`` (the WAN stayed down
past ``max_outage_s``), the attempt is torn down (sender, replicas, edge, model), the
stage posts RECOVERING and opens the next epoch (max(own + 1, the required one)), where
both stages restart from the last checkpoint step they all hold (``resume``). A runner built
with ``epoch > 0`` (its trainer died and came back) starts that way. Stateful codecs restart
fresh in every epoch on both sides (each epoch has its own ``EdgeConnection`` and codec streams).
At most ``EdgeSettings.max_recoveries`` recoveries; a program error or the peer's error
close still ends the stage FAILED.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

from nebula_common.data.batches import GrantedBatchSource
from nebula_common.jobspec.runtime import ProgramError, StageProgram
from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer.edge import (
    EdgeClosedError,
    EdgeConnection,
    EdgeFactory,
    EdgeOutage,
    EdgeRestartRequired,
    EdgeSettings,
    grpc_edge_factory,
    renewed,
)
from services.trainer.metrics import record_step
from services.trainer.runtime.chain import FailureRelay, combined_stats, edge_traffic, edge_views
from services.trainer.runtime.checkpoint import CheckpointStore
from services.trainer.runtime.evaluation import evaluate, evaluates
from services.trainer.runtime.lifecycle import StageLifecycle
from services.trainer.runtime.parallel import DataParallelGroup
from services.trainer.runtime.program import build_program, load_starting_state
from services.trainer.runtime.rank_group import RankGroup, RankSource
from services.trainer.runtime.resume import (
    PeerAlreadyFinished,
    conclude_finished,
    exchange_resume,
    resumed_spec,
)
from services.trainer.runtime.role_steps import RoleSteps, role_steps
from services.trainer.runtime.stage_edges import abort_all, attempt_settings, open_edge, start_barrier
from services.trainer.runtime.stage_placement import compute_group, save_checkpoint
from services.trainer.runtime.stage_reports import StepSink, report_running, report_step, report_traffic
from services.trainer.runtime.timers import StepTimer
from services.trainer.runtime.transfer import AsyncSender, ReceiveAhead
from services.trainer.status import StatusBoard

log = logging.getLogger(__name__)
RECOVERING = trainer_pb2.STAGE_STATE_RECOVERING


class ProgramRunner:
    """Runs one stage of a user program: the training loop, inside a ``StageLifecycle``.

    The lifecycle owns the thread, cancellation and the terminal state; this class only
    trains, reports each step (status board and Prometheus) and closes its edge cleanly, and
    restarts itself from the common checkpoint when its attempt is lost (see the module doc).

    ``epoch``: 0 for a fresh job; > 0 for a stage whose trainer died (it starts RECOVERING).
    ``on_epoch(e)`` is called on the stage thread right before a stream of epoch ``e > 0``
    opens, so a persisted record holds ``e`` before any item of ``e`` is sent.
    """

    def __init__(
        self,
        spec: trainer_pb2.StageSpec,
        token: str,
        switch_address: str,
        data_dir: Path,
        owner: str,
        data_service_address: str | None = None,
        *,
        edge_factory: EdgeFactory | None = None,
        edge_settings: EdgeSettings | None = None,
        epoch: int = 0,
        on_epoch: Callable[[int], None] | None = None,
        receive_ahead: int | None = None,
        cluster_ranks: RankSource | None = None,
        step_sink: StepSink = record_step,
    ) -> None:
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if receive_ahead is not None and receive_ahead < 0:
            raise ValueError(
                f"receive_ahead must be >= 0 (0: receive on the stage thread), got {receive_ahead}"
            )
        self.receive_ahead = receive_ahead
        self.step_sink = step_sink
        """Where each step's numbers go besides the board (a stage process: to its trainer)."""
        self.cluster_ranks = cluster_ranks
        """Rank processes started on their own (``worker.py``) that compute this stage, if any."""
        self.timer = StepTimer()
        """Seconds per operation of this stage's steps (see ``runtime.timers``)."""
        self.step_timings: list[dict[str, float]] = []
        """Per step of the last attempt: the ``StepTimer`` snapshot at its end."""
        self.windows: list[int] = []
        """A 1F1B upstream's activations in flight per step of the last attempt (see ``upstream_steps``)."""
        self.window_inputs: list[tuple[float, float]] = []
        """Per step that sized the next window: (gradient latency s, compute per micro-batch s)."""
        self.spec = spec
        self.epoch = epoch
        self.on_epoch = on_epoch
        self.recoveries = 0
        self.token = token
        self.switch_address = switch_address
        self.edge_factory = edge_factory or grpc_edge_factory(switch_address, lambda: self.token)
        self.edge_settings = edge_settings or EdgeSettings()
        self.lifecycle = StageLifecycle(spec.job_id, spec.stage, self._run_stage, cleanup=self._stop_helpers)
        self.data_service_address = data_service_address
        self.store = CheckpointStore(data_dir)
        self.owner = owner
        self._sender: AsyncSender | None = None
        self._receiver: ReceiveAhead | None = None
        self._dp: DataParallelGroup | RankGroup | None = None
        self._middle = spec.program.role == "middle"
        self.edge: EdgeConnection | None = None
        """The stage's edge (a middle stage of a chain: its upstream edge; ``down`` is its other one)."""
        self.down: EdgeConnection | None = None
        self._down_sender: AsyncSender | None = None
        self._down_receiver: ReceiveAhead | None = None
        self._relay: FailureRelay | None = None
        self.program: StageProgram | None = None  # once built (tests compare final parameters)

    @property
    def board(self) -> StatusBoard:
        """The stage's status history, which every WatchStage stream reads."""
        return self.lifecycle.board

    def start(self) -> None:
        self.lifecycle.start()

    def cancel(self) -> None:
        """Stop at once, even while blocked waiting for the other cluster."""
        self.lifecycle.cancel()

    def join(self, timeout: float | None = None) -> None:
        self.lifecycle.join(timeout)

    def release(self) -> None:
        """Drop what only a running stage needs (model, optimizer, edge buffers, replicas).

        The trainer keeps a finished stage's runner for its status board; without this each
        finished job would keep its model and its edge's retransmit buffer alive (the soak saw the
        trainers grow 6-8 MiB per job). Call only after the stage has ended.
        """
        if self.program is not None:  # the stage module's unique sys.modules entry goes with it
            sys.modules.pop(getattr(self.program.module, "__name__", ""), None)
        self.program = None
        self.edge = None
        self.down = None
        self._sender = None
        self._receiver = None
        self._down_sender = None
        self._down_receiver = None
        self._relay = None
        self._dp = None
        self.lifecycle.release()

    def _stop_helpers(self) -> None:
        """After the body, however it ended: no sender or receive thread or replica outlives the stage.

        The lifecycle has aborted the edge by now if the body failed, so a receive in progress ends.
        """
        if self._relay is not None:
            self._relay.stop()
        for sender in (self._sender, self._down_sender):
            if sender is not None:
                sender.stop(discard=True)  # after a clean stop() this returns at once
        for receiver in (self._receiver, self._down_receiver):
            if receiver is not None:
                receiver.stop()
        if self._dp is not None:
            self._dp.abort()  # after a clean stop() this only reaps; otherwise it ends the replicas

    def _granted_examples(self) -> GrantedBatchSource | None:
        """The granted dataset this stage trains on, read through its owner's data service."""
        dataset = self.spec.program.dataset
        if not dataset:
            return None
        if not self.data_service_address:
            raise ProgramError(
                f"stage {self.spec.stage!r} trains on dataset {dataset!r} but this trainer has no "
                "data service (NEBULA_TRAINER_DATA_SERVICE_ADDRESS)"
            )
        return GrantedBatchSource(self.data_service_address, lambda: self.token, dataset)

    def _run_stage(self) -> None:
        """The stage's body: attempts, one per epoch, until one finishes (or fails for good)."""
        limit = self.edge_settings.max_recoveries
        if self.epoch > 0:
            self._post_recovering(
                f"this stage's trainer restarted; resuming from the last common checkpoint "
                f"(epoch {self.epoch})"
            )
        while True:
            try:
                self._attempt(self.epoch)
                return
            except (EdgeRestartRequired, EdgeOutage) as exc:
                self.lifecycle.raise_if_cancelled()
                self._end_attempt(str(exc))
                if self.recoveries >= limit:
                    raise EdgeClosedError(
                        f"gave up after {limit} recoveries (max_recoveries, NEBULA_TRAINER_MAX_RECOVERIES); "
                        f"the last attempt ended: {exc}"
                    ) from exc
                self.recoveries += 1
                required = exc.epoch if isinstance(exc, EdgeRestartRequired) else 0
                self.epoch = max(self.epoch + 1, required)
                why = (
                    f"the other cluster's stage restarted ({exc})"
                    if isinstance(exc, EdgeRestartRequired)
                    else str(exc)
                )
                log.warning(
                    "stage recovering",
                    extra={"fields": {"job_id": self.spec.job_id, "epoch": self.epoch, "reason": why}},
                )
                self._post_recovering(
                    f"{why}; resuming from the last common checkpoint (epoch {self.epoch}, "
                    f"recovery {self.recoveries} of at most {limit})"
                )

    def _post_recovering(self, message: str) -> None:
        self.board.update(state=RECOVERING, epoch=self.epoch, message=message)

    def _end_attempt(self, reason: str) -> None:
        """Tear a lost attempt down: sender, replicas, edge and model go; the next epoch rebuilds them."""
        if self._relay is not None:
            self._relay.stop()
            self._relay = None
        for sender in (self._sender, self._down_sender):
            if sender is not None:
                sender.stop(discard=True)  # kept (stopped) until the next attempt replaces it
        if self._dp is not None:
            self._dp.abort()
            self._dp = None
        for edge in (self.edge, self.down):
            if edge is not None:  # already ended; makes sure the stream is shut
                edge.session.fail(reason, tell_peer=False)
        self.edge = self.down = None
        for receiver in (self._receiver, self._down_receiver):
            if receiver is not None:
                receiver.stop()  # after the edge failed: a receive in progress has ended
        if self.program is not None:
            sys.modules.pop(getattr(self.program.module, "__name__", ""), None)
            self.program = None

    def _open_edges(self, epoch: int) -> list[EdgeConnection]:
        """The attempt's edges, opened before anything is built: anything failing below (a bad module,
        a missing grant, a checkpoint that will not load) reaches the other cluster as an error close
        at once, instead of leaving its stage waiting for tensors that will never come."""
        spec = self.spec
        settings = attempt_settings(self.edge_settings, spec.program)
        if epoch > 0 and self.on_epoch is not None:
            self.on_epoch(epoch)
        if not self._middle:
            self.edge = edge = open_edge(self.edge_factory, spec, settings, epoch, self.lifecycle)
            self.lifecycle.attach_abort(edge.abort)
            return [edge]
        # a chain's middle: both edges open before anything else (see runtime.chain)
        up_view, down_view = edge_views(spec)
        self.edge = edge = open_edge(self.edge_factory, up_view, settings, epoch, self.lifecycle)
        self.lifecycle.attach_abort(edge.abort)
        self.down = down = open_edge(self.edge_factory, down_view, settings, epoch, self.lifecycle)
        self._relay = FailureRelay((edge, down))
        self.lifecycle.attach_abort(abort_all(edge, down))
        return [edge, down]

    def _attempt(self, epoch: int) -> None:
        """One attempt (epoch): returns when every step (and the evaluation) is done and the edge closed."""
        spec, cfg = self.spec, self.spec.program
        upstream = cfg.role == "upstream"
        edges = self._open_edges(epoch)
        edge, down = edges[0], (edges[1] if len(edges) > 1 else None)
        start_spec = spec
        if epoch > 0:
            try:
                held = self.store.steps(self.owner, spec.job_id, spec.stage)
                common = exchange_resume(spec, held, edges, epoch, self.board)
            except PeerAlreadyFinished:
                if self._relay is not None:
                    self._relay.stop()
                conclude_finished(spec, edges, self.board)
                return
            if common is not None:  # restart from our own checkpoint (replicas load the same)
                start_spec = resumed_spec(spec, common)
        self.program = program = build_program(spec, self._granted_examples())
        start = load_starting_state(start_spec, program, self.store, self.owner)
        if epoch > 0:  # later checkpoints are of the void attempt: a later recovery must not pick them
            self.store.discard_after(self.owner, spec.job_id, spec.stage, start)
        # Who computes the stage, for its log record: this thread, replicas, or rank processes.
        self._dp, placement = compute_group(start_spec, program, self.cluster_ranks, self.store, self.owner)
        start_barrier(spec, edge, upstream, down)
        timer = self.timer
        timer.take()  # start-up is not a step
        self._sender = sender = AsyncSender(edge, cfg.max_in_flight, timer)
        depth = max(2, cfg.max_in_flight) if self.receive_ahead is None else self.receive_ahead
        one_way = cfg.mode == "one_way"
        sizes_window = upstream and not one_way and down is None and cfg.schedule == "1f1b"
        self._receiver = receiver = ReceiveAhead(edge, depth, timer, track_arrivals=sizes_window)
        below: tuple[ReceiveAhead, AsyncSender] | None = None
        if down is not None:
            self._down_sender = AsyncSender(down, cfg.max_in_flight, timer)
            self._down_receiver = ReceiveAhead(down, depth, timer)
            below = (self._down_receiver, self._down_sender)
        self.windows, self.window_inputs = [], []
        steps = role_steps(
            spec,
            program,
            self._dp,
            start,
            receiver=receiver,
            sender=sender,
            below=below,
            windows=self.windows,
            window_inputs=self.window_inputs,
        )
        self.step_timings = []
        report_running(self.board, start, epoch)
        log.info(
            "program stage running",
            extra={"fields": {"job_id": spec.job_id, "stage": spec.stage, **placement}},
        )
        self._train(steps, program, start, edges)
        if evaluates(spec, program):
            evaluate(spec, program, receiver, sender, upstream, self.store, self.owner)
        self._close(edges)

    def _train(
        self, steps: RoleSteps, program: StageProgram, start: int, edges: list[EdgeConnection]
    ) -> None:
        """The attempt's steps from ``start``: each timed, checkpointed at the boundaries, reported."""
        spec, cfg = self.spec, self.spec.program
        for step in range(start, spec.steps):
            self.lifecycle.raise_if_cancelled()
            started = time.perf_counter()
            loss, extra = steps.run(step)
            elapsed = time.perf_counter() - started
            timings = self.timer.take()
            timings["compute"] = max(elapsed - timings["wait"], 0.0)
            self.step_timings.append(timings)
            waited = timings["wait"]
            done = step + 1
            extra["compute_seconds"] = timings["compute"]
            if done == spec.steps or (cfg.checkpoint_interval and done % cfg.checkpoint_interval == 0):
                save_checkpoint(spec, done, program, self._dp, self.store, self.owner)
                extra["checkpoint_step"] = done
            extra["edges"] = edge_traffic(edges)
            report_step(
                self.board, self.step_sink, spec, step, elapsed, waited, loss, combined_stats(edges), **extra
            )

    def _close(self, edges: list[EdgeConnection]) -> None:
        """End a finished attempt in order: flush what is still to send, stop the helpers, close the edges."""
        middle = len(edges) > 1
        for ending_sender in (self._sender, self._down_sender if middle else None):
            if ending_sender is not None:
                ending_sender.flush()
                ending_sender.stop()
        for ending_receiver in (self._receiver, self._down_receiver if middle else None):
            if ending_receiver is not None:
                ending_receiver.stop()
        if self._dp is not None:
            self._dp.stop()
        if self._relay is not None:
            self._relay.stop()  # closing in order is not a failure to pass on
        for end in reversed(edges):  # a middle closes below first: every gradient up has been sent
            end.close("finished")
        report_traffic(self.board, edges)  # every frame sent is counted now (the senders were flushed)
        for end in edges:
            lost = end.session.failure
            if isinstance(lost, EdgeRestartRequired | EdgeOutage):  # the peer restarted before it closed
                raise renewed(lost)


__all__ = ["ProgramRunner"]
