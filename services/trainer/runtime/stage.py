"""One stage of a user program on this trainer: the cross-cluster pipeline loop.

backprop mode (the numbers and abnet jobs): the upstream stage runs its schedule's forwards and
backwards (GPipe or 1F1B), sending activations through an async bounded queue
and applying gradients in micro-batch order as they return; the downstream
stage turns each arriving activation into a loss, backpropagates, and sends the
activation's gradient straight back.

one_way mode (ELECTRA, the paper's Scenario I): the upstream stage (generator)
trains on its own loss and sends only what it produced (e.g. corrupted token
ids, which travel exactly as int64); no gradient crosses. After each optimizer
step the downstream stage (the root discriminator, whose data-parallel replicas
have synced first) returns a SYNC signal for the step, values ``[loss]``; the upstream stage may run at most
``sync_lag`` steps ahead of the last sync it received, so both sides stay on
the same pace while the generator's next step overlaps the discriminator's.

Both sides step their optimizer once per step, at the same step boundaries, and
checkpoint there.

Recovery (relay.proto, "Epochs"). Each attempt of the stage runs in an epoch of its
edge (0 for a fresh job). When the edge ends with ``EdgeRestartRequired`` (the other
cluster's stage restarted, or gave up an attempt) or ``EdgeOutage`` (the WAN stayed down
past ``max_outage_s``), the attempt is torn down (sender, replicas, edge, model), the
stage posts RECOVERING and opens the next epoch (max(own + 1, the required one)); it
waits for the link without a deadline (a cancel still stops it), both stages exchange
RESUME signals listing the checkpoint steps they hold, and both restart from the highest
step in both lists (none: the job's own starting state), deleting their checkpoints of
later steps (they belong to the void attempt). A runner built with ``epoch > 0`` (its
trainer died and came back) starts that way. Stateful codecs restart fresh in every
epoch on both sides (each epoch has its own ``EdgeConnection`` and codec streams).
At most ``EdgeSettings.max_recoveries`` recoveries; a program error or the peer's error
close still ends the stage FAILED.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from nebula_common.data.batches import GrantedBatchSource
from nebula_common.jobspec.runtime import ProgramError, StageProgram, example_ids
from nebula_common.jobspec.spec import sharding_problem
from nebula_common.proto.nebula.v1 import relay_pb2, trainer_pb2
from services.trainer.edge import (
    EdgeClosedError,
    EdgeConnection,
    EdgeFactory,
    EdgeOutage,
    EdgeRestartRequired,
    EdgeSettings,
    EdgeStats,
    EdgeTimeout,
    grpc_edge_factory,
    renewed,
)
from services.trainer.metrics import record_step
from services.trainer.rank_accounts import may_use_ranks
from services.trainer.runtime.chain import (
    FailureRelay,
    LocalMiddle,
    MiddleStep,
    combined_stats,
    edge_traffic,
    edge_views,
)
from services.trainer.runtime.checkpoint import CheckpointStore
from services.trainer.runtime.lifecycle import StageLifecycle
from services.trainer.runtime.parallel import DataParallelGroup
from services.trainer.runtime.program import build_program, load_starting_state
from services.trainer.runtime.rank_group import RankGroup, Ranks
from services.trainer.runtime.rank_sources import AttachedRanks, ClusterRanks, SpawnedRanks
from services.trainer.runtime.schedule import covering_window, downstream_ops, upstream_ops
from services.trainer.runtime.sharding import SHARDED
from services.trainer.runtime.timers import StepTimer
from services.trainer.runtime.transfer import AsyncSender, ReceiveAhead
from services.trainer.status import StatusBoard

log = logging.getLogger(__name__)
START_TIMEOUT_S = 600.0
PEER_FINISHED_AFTER_S = 60.0
"""A restarted stage that holds its final checkpoint and hears no RESUME for this long (link up)
concludes the other cluster's stage had already finished (see ``PeerAlreadyFinished``)."""
OPEN_RETRY_S = 5.0
READY = relay_pb2.SIGNAL_KIND_READY
SYNC = relay_pb2.SIGNAL_KIND_SYNC
EVAL_DONE = relay_pb2.SIGNAL_KIND_EVAL_DONE
RESUME = relay_pb2.SIGNAL_KIND_RESUME
RECOVERING = trainer_pb2.STAGE_STATE_RECOVERING


class PeerAlreadyFinished(Exception):
    """A recovering stage that had done all its steps found its peer gone: the job had finished.

    A stage ends its last step only once it has everything the other stage sends for it, and it
    checkpoints then; if its trainer is killed after that (e.g. while closing the edge) and the other
    stage, which had all it needed, finished meanwhile, nobody will ever answer its RESUME. Waiting
    START_TIMEOUT_S and failing would report a finished job as failed.
    """


def _abort_all(*edges: EdgeConnection) -> Callable[[str], None]:
    """One abort hook for a stage with several edges (a chain's middle): each is told and torn down."""

    def abort(reason: str) -> None:
        for edge in edges:
            edge.abort(reason)

    return abort


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
        cluster_ranks: ClusterRanks | None = None,
        step_sink: Callable[[str, str, float, float, float | None], None] = record_step,
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
        """A 1F1B upstream's activations in flight per step of the last attempt (see ``_upstream_step``)."""
        self.window_inputs: list[tuple[float, float]] = []
        """Per step that sized the next window: (gradient latency s, compute per micro-batch s)."""
        self._window: int | None = None
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
        self._posted_through = -1
        self._dp: DataParallelGroup | RankGroup | None = None
        self._one_way = spec.program.mode == "one_way"
        self._int_payload = spec.program.payload == "int64"
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

    def _start_barrier(
        self, edge: EdgeConnection, upstream: bool, down: EdgeConnection | None = None
    ) -> None:
        """Start step ``start`` only once the other cluster's stage is built and ready.

        Building a stage can take seconds (module import, model build, checkpoint load,
        spawning data-parallel replicas). Without this barrier the upstream would start
        stepping and count that start-up as time spent waiting for the other cluster,
        which would hide the steady-state balance the wait metrics exist to show. The
        downstream announces readiness with a READY signal on the backward direction
        (a signal, not a tensor, so no codec state is touched).
        """
        started = time.perf_counter()
        if down is not None:  # a middle of a chain: ready once every stage below is, then says so above
            down.receive_signal(READY, 0, timeout=START_TIMEOUT_S)
            down.stats.wait_seconds = 0.0
            edge.send_signal(READY, 0)
        elif upstream:
            edge.receive_signal(READY, 0, timeout=START_TIMEOUT_S)
        else:
            edge.send_signal(READY, 0)
        edge.stats.wait_seconds = 0.0  # the barrier is start-up, not training wait
        log.info(
            "stage ready",
            extra={
                "fields": {
                    "job_id": self.spec.job_id,
                    "stage": self.spec.stage,
                    "waited_for_peer_seconds": round(time.perf_counter() - started, 3),
                }
            },
        )

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

    def _exchange_resume(self, edges: list[EdgeConnection], epoch: int) -> int | None:
        """First items of a new epoch: the checkpoint steps every stage holds; the common step (or None).

        Waits for the link first, without a deadline (the WAN may be down for long; a cancel
        aborts the edge and ends the wait). Each round, a stage sends the steps it knows to be
        held by every stage it has heard of to each neighbour (``edges``: one, or a middle's
        two), then takes theirs: after ``stages - 1`` rounds every stage of the chain knows the
        steps all of them hold (two stages: one round, each sends its own list). Every stage
        sends before it receives, so no stage waits for one that waits for it.
        """
        spec = self.spec
        held = self.store.steps(self.owner, spec.job_id, spec.stage)
        for edge in edges:
            if not edge.session.link_up:
                self.board.update(message=f"{self.board.latest().message}; waiting for the WAN link")
                edge.session.wait_link_up()
        finished = spec.steps in held  # every step done before this attempt began
        known = set(held)
        heard: list[list[float]] = []
        for round_ in range((spec.program.stage_count or 2) - 1):
            for edge in edges:
                edge.send_signal(RESUME, epoch, [float(step) for step in sorted(known)])
            for edge in edges:
                first = round_ == 0 and finished
                try:
                    values = edge.receive_signal(
                        RESUME, epoch, timeout=PEER_FINISHED_AFTER_S if first else START_TIMEOUT_S
                    )
                except EdgeTimeout as exc:
                    if first:
                        raise PeerAlreadyFinished from exc
                    raise
                if any(v < 0 or v != int(v) for v in values):
                    raise EdgeClosedError(f"invalid RESUME from the peer: checkpoint steps {values}")
                heard.append(values)
            for values in heard[-len(edges) :]:
                known &= {int(v) for v in values}
        log.info(
            "resume exchanged",
            extra={"fields": {"job_id": spec.job_id, "epoch": epoch, "held": held, "peer": heard}},
        )
        return max(known) if known else None

    def _open_edge(
        self, settings: EdgeSettings, epoch: int, spec: trainer_pb2.StageSpec | None = None
    ) -> EdgeConnection:
        """The attempt's edge (``spec``: a middle stage's view of one of its edges). A recovering stage
        whose switch does not answer (it is down too) keeps trying, without a deadline, in slices of at
        most ``OPEN_RETRY_S`` so a cancel ends it soon."""
        spec = spec or self.spec
        if epoch == 0:
            return self.edge_factory(spec, settings, epoch)
        settings = dataclasses.replace(settings, ready_timeout_s=min(settings.ready_timeout_s, OPEN_RETRY_S))
        told = False
        while True:
            self.lifecycle.raise_if_cancelled()
            try:
                return self.edge_factory(spec, settings, epoch)
            except EdgeOutage as exc:
                if not told:
                    waiting = f"{self.board.latest().message}; waiting for this cluster's switch"
                    self.board.update(message=waiting)
                    told = True
                log.warning(
                    "recovering stage: switch did not answer; opening again",
                    extra={"fields": {"job_id": self.spec.job_id, "epoch": epoch, "reason": str(exc)}},
                )

    def _rank_processes(self, spec: trainer_pb2.StageSpec) -> Ranks | None:
        """The rank processes this attempt computes on, if not the stage thread itself (or DDP replicas).

        The cluster's own ranks (``ClusterRanks``) take every stage that may run data-parallel,
        whatever its ``replicas``: the same spec runs on 1 rank or many. A sharded stage on a
        trainer without them gets ``replicas`` spawned ranks.
        """
        cfg = spec.program
        if self.cluster_ranks is not None and may_use_ranks(spec):  # see validation: one process
            world = self.cluster_ranks.world
            micro = cfg.batch_size // cfg.micro_batches
            problem = sharding_problem(cfg.parallel or "ddp", max(world, 2), cfg.shard_size or None)
            problems = [f"program.{problem}"] if problem else []
            if micro % world:
                problems.append(f"they split each micro-batch evenly; {world} does not divide {micro}")
            if problems:
                raise ProgramError(
                    f"this cluster's {world} ranks cannot run the stage: {'; '.join(problems)}"
                )
            return self.cluster_ranks.attach(spec.SerializeToString(), self.owner)
        if cfg.replicas > 1 and cfg.parallel in SHARDED:
            return SpawnedRanks(spec.SerializeToString(), cfg.replicas, str(self.store.root), self.owner)
        return None

    def _discard_checkpoints_after(self, step: int) -> None:
        """Checkpoints past the restart step are of the void attempt: a later recovery must not pick them."""
        spec = self.spec
        directory = self.store.stage_dir(self.owner, spec.job_id, spec.stage)
        for later in self.store.steps(self.owner, spec.job_id, spec.stage):
            if later > step:
                shutil.rmtree(directory / f"step-{later}", ignore_errors=True)

    def _attempt(self, epoch: int) -> None:
        """One attempt (epoch): returns when every step (and the evaluation) is done and the edge closed."""
        spec, cfg = self.spec, self.spec.program
        upstream = cfg.role == "upstream"
        # The edge opens first, so that anything failing below (a bad module, a missing grant, a
        # checkpoint that will not load) reaches the other cluster as an error close at once,
        # instead of leaving its stage waiting for tensors that will never come.
        # one_way: the upstream holds up to sync_lag + 1 unread syncs while it keeps sending.
        queue_items = max(2 * cfg.max_in_flight, cfg.sync_lag + 2) + 1
        settings = dataclasses.replace(self.edge_settings, receive_queue_items=queue_items)
        if epoch > 0 and self.on_epoch is not None:
            self.on_epoch(epoch)
        down: EdgeConnection | None = None
        if self._middle:  # a chain's middle: both edges open before anything else (see runtime.chain)
            up_view, down_view = edge_views(spec)
            self.edge = edge = self._open_edge(settings, epoch, up_view)
            self.lifecycle.attach_abort(edge.abort)
            self.down = down = self._open_edge(settings, epoch, down_view)
            self._relay = FailureRelay((edge, down))
            self.lifecycle.attach_abort(_abort_all(edge, down))
        else:
            self.edge = edge = self._open_edge(settings, epoch)
            self.lifecycle.attach_abort(edge.abort)
        edges = [edge] if down is None else [edge, down]
        start_spec = spec
        if epoch > 0:
            try:
                common = self._exchange_resume(edges, epoch)
            except PeerAlreadyFinished:
                if self._relay is not None:
                    self._relay.stop()
                for end in edges:
                    end.session.fail("finished", tell_peer=False)
                self.board.update(
                    state=trainer_pb2.STAGE_STATE_RUNNING,
                    steps_done=spec.steps,
                    message=f"all {spec.steps} steps were done before this attempt; the other cluster's "
                    f"stage had finished (no RESUME in {PEER_FINISHED_AFTER_S:.0f} s)",
                )
                return
            if common is not None:  # restart from our own checkpoint (replicas load the same)
                start_spec = trainer_pb2.StageSpec()
                start_spec.CopyFrom(spec)
                start_spec.program.ClearField("initial_state")
                start_spec.program.ClearField("initial_step")
                start_spec.program.resume_job_id = spec.job_id
                start_spec.program.resume_step = common
        self.program = program = build_program(spec, self._granted_examples())
        start = load_starting_state(start_spec, program, self.store, self.owner)
        if epoch > 0:
            self._discard_checkpoints_after(start)
        ranks = self._rank_processes(start_spec)
        # Who computes the stage, for its log record: this thread, replicas, or rank processes.
        placement: dict[str, object] = {"ranks": ranks.world if ranks is not None else max(cfg.replicas, 1)}
        if isinstance(ranks, AttachedRanks) and self.cluster_ranks is not None:
            placement["rank_hosts"] = [str(w.get("host", "?")) for w in self.cluster_ranks.joined()]
        if ranks is not None:
            self._dp = RankGroup(
                ranks,
                program,
                micro_batches=cfg.micro_batches,
                backprop=not self._one_way,
                store=self.store,
                owner=self.owner,
                upstream=upstream,
                middle=self._middle,
            )
            placement["rank_parameter_bytes"] = self._dp.parameter_bytes
        elif cfg.replicas > 1:
            self._dp = DataParallelGroup(
                start_spec.SerializeToString(),
                program,
                replicas=cfg.replicas,
                micro_batches=cfg.micro_batches,
                backprop=not self._one_way,
                data_dir=self.store.root,
                owner=self.owner,
                upstream=upstream,
                middle=self._middle,
            )
        self._start_barrier(edge, upstream, down)
        timer = self.timer
        timer.take()  # start-up is not a step
        sender = AsyncSender(edge, cfg.max_in_flight, timer)
        self._sender = sender
        depth = max(2, cfg.max_in_flight) if self.receive_ahead is None else self.receive_ahead
        sizes_window = upstream and not self._one_way and down is None and cfg.schedule == "1f1b"
        self._receiver = receiver = ReceiveAhead(edge, depth, timer, track_arrivals=sizes_window)
        middle: MiddleStep | None = None
        if down is not None:
            self._down_sender = AsyncSender(down, cfg.max_in_flight, timer)
            self._down_receiver = ReceiveAhead(down, depth, timer)
            # On n ranks (replicas, or rank processes) each rank relays its rows of every micro-batch.
            compute = self._dp if self._dp is not None else LocalMiddle(program)
            middle = MiddleStep(
                compute,
                cfg.schedule,
                cfg.micro_batches,
                cfg.max_in_flight,
                from_above=receiver,
                to_above=sender,
                from_below=self._down_receiver,
                to_below=self._down_sender,
            )
        self._posted_through = start - 1
        self.step_timings = []
        self.windows, self.window_inputs, self._window = [], [], None
        status: dict[str, object] = dict(state=trainer_pb2.STAGE_STATE_RUNNING, steps_done=start, epoch=epoch)
        if epoch > 0:
            message = f"recovered: epoch {epoch} resumed from step {start}"
            status.update(resumed_from_step=start, message=message)
        self.board.update(**status)
        log.info(
            "program stage running",
            extra={"fields": {"job_id": spec.job_id, "stage": spec.stage, **placement}},
        )
        for step in range(start, spec.steps):
            self.lifecycle.raise_if_cancelled()
            started = time.perf_counter()
            extra: dict[str, object] = {}
            loss: float | None = None
            if middle is not None:
                middle.run(step, {mb: self._ids(step, mb) for mb in range(cfg.micro_batches)})
                if self._dp is not None:
                    self._dp.finish_step(step)  # the ranks sum their gradients and step together
                else:
                    program.finish_step()
            elif upstream and self._one_way:
                extra["local_loss"] = self._upstream_one_way_step(program, sender, step)
                program.finish_step()
                self._await_syncs(receiver, start, step)
            elif upstream:
                self._upstream_step(program, receiver, sender, step)
                if self._dp is not None:
                    self._dp.finish_step(step)  # the replicas sum their gradients and step together
                else:
                    program.finish_step()
            else:
                loss = self._downstream_step(program, receiver, sender, step)
                if self._dp is not None:
                    self._dp.finish_step(step)  # replicas sync first ...
                else:
                    program.finish_step()
                if self._one_way:  # ... then the root syncs with the upstream stage
                    sender.send_signal(SYNC, step, [loss])
            elapsed = time.perf_counter() - started
            timings = timer.take()
            timings["compute"] = max(elapsed - timings["wait"], 0.0)
            self.step_timings.append(timings)
            waited = timings["wait"]
            done = step + 1
            extra["compute_seconds"] = timings["compute"]
            if done == spec.steps or (cfg.checkpoint_interval and done % cfg.checkpoint_interval == 0):
                if isinstance(self._dp, RankGroup):  # every rank writes its part
                    self._dp.save_checkpoint(spec.job_id, spec.stage, done, final=done == spec.steps)
                else:
                    self.store.save(spec.job_id, spec.stage, self.owner, done, program)
                extra["checkpoint_step"] = done
            extra["edges"] = edge_traffic(edges)
            self._report_step(step, elapsed, waited, loss, combined_stats(edges), **extra)
        evaluates = callable(getattr(program.module, "load_eval_examples", None))
        if not self._one_way and evaluates and not (cfg.stage_count or 2) > 2:
            self._evaluate(program, receiver, sender, upstream)
        for ending_sender in (sender, self._down_sender if down is not None else None):
            if ending_sender is not None:
                ending_sender.flush()
                ending_sender.stop()
        for ending_receiver in (receiver, self._down_receiver if down is not None else None):
            if ending_receiver is not None:
                ending_receiver.stop()
        if self._dp is not None:
            self._dp.stop()
        if self._relay is not None:
            self._relay.stop()  # closing in order is not a failure to pass on
        for end in reversed(edges):  # a middle closes below first: every gradient up has been sent
            end.close("finished")
        self._report_traffic(edges)  # every frame sent is counted now (the senders were flushed)
        for end in edges:
            lost = end.session.failure
            if isinstance(lost, EdgeRestartRequired | EdgeOutage):  # the peer restarted before it closed
                raise renewed(lost)

    def _report_traffic(self, edges: list[EdgeConnection]) -> None:
        """The edges' final counters, per edge and summed (after the last step's sends were flushed)."""
        stats = combined_stats(edges)
        self.board.update(
            bytes_sent=stats.bytes_sent,
            bytes_received=stats.bytes_received,
            raw_bytes_sent=stats.raw_bytes_sent,
            raw_bytes_received=stats.raw_bytes_received,
            edges=edge_traffic(edges),
        )

    def _report_step(
        self,
        step: int,
        elapsed: float,
        waited: float,
        loss: float | None,
        stats: EdgeStats,
        **extra: object,
    ) -> None:
        """One step's numbers to the status board (what watchers see) and to Prometheus."""
        self.step_sink(self.spec.job_id, self.spec.stage, elapsed, waited, loss)
        fields: dict[str, object] = dict(
            steps_done=step + 1,
            step_seconds=elapsed,
            wait_seconds=waited,
            bytes_sent=stats.bytes_sent,
            bytes_received=stats.bytes_received,
            raw_bytes_sent=stats.raw_bytes_sent,
            raw_bytes_received=stats.raw_bytes_received,
            **extra,
        )
        if loss is not None:
            fields["loss"] = loss
        self.board.update(**fields)

    def _evaluate(
        self, program: StageProgram, receiver: ReceiveAhead, sender: AsyncSender, upstream: bool
    ) -> None:
        """Held-out evaluation after the last step (backprop jobs whose modules define it).

        Both modules define ``load_eval_examples(options)``; the downstream one also
        ``decode(model, received, batch) -> list[str]`` and ``score(outputs, examples) -> dict``.
        The upstream stage sends each eval batch's output once (frames of step ``steps``,
        micro-batch = batch index, example ids after the training ids), with no gradient
        back; the downstream decodes each (e.g. greedy, autoregressively, all locally),
        scores where its references live, writes ``eval.json`` into its own job directory,
        and sends an EVAL_DONE signal with the batch count so the upstream knows it finished.
        """
        cfg, module = self.spec.program, program.module
        if not upstream and not (callable(getattr(module, "decode", None)) and callable(module.score)):
            raise ProgramError("an evaluating downstream module must define decode() and score()")
        started = time.perf_counter()
        examples = module.load_eval_examples(program.options)
        size = cfg.batch_size // cfg.micro_batches
        step = self.spec.steps
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
            "job_id": self.spec.job_id,
            "stage": self.spec.stage,
            "examples": len(examples),
            "batches": batches,
            "eval_seconds": time.perf_counter() - started,
            "metrics": {name: float(value) for name, value in dict(metrics).items()},
            "outputs": outputs,
        }
        directory = self.store.stage_dir(self.owner, self.spec.job_id, self.spec.stage)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "eval.json").write_text(json.dumps(record, indent=1, ensure_ascii=False))
        log.info("evaluation done", extra={"fields": {"job_id": self.spec.job_id, **record["metrics"]}})
        sender.send_signal(EVAL_DONE, step, [float(batches)])

    def _ids(self, step: int, micro_batch: int) -> list[int]:
        cfg = self.spec.program
        size = cfg.batch_size // cfg.micro_batches
        return example_ids(cfg.seed, cfg.num_examples, step, micro_batch, cfg.micro_batches, size)

    def _upstream_step(
        self, program: StageProgram, receiver: ReceiveAhead, sender: AsyncSender, step: int
    ) -> None:
        cfg = self.spec.program
        outputs: dict[int, torch.Tensor] = {}
        # 1F1B's window: the job's max_in_flight (the memory allowed) until a step has measured
        # what covers the gradients' round trip, then that (see covering_window). Only when and
        # how many forwards run ahead changes, never what is computed: training is bit-identical.
        window = min(cfg.max_in_flight, cfg.micro_batches) if self._window is None else self._window
        self.windows.append(window)
        ops = upstream_ops(cfg.schedule, cfg.micro_batches, window)
        for op in ops:  # the gradients, in the order the schedule applies them, decoded as they come
            if op.kind == "B":
                receiver.expect_tensor(step, op.micro_batch, self._ids(step, op.micro_batch))
        sent_at: dict[int, float] = {}
        computing = 0.0
        for op in ops:
            if op.kind == "F":
                ids = self._ids(step, op.micro_batch)
                started = time.perf_counter()
                if self._dp is not None:  # every rank runs its rows; rank 0 sends them gathered
                    out = self._dp.forward(step, op.micro_batch, ids)
                else:
                    outputs[op.micro_batch] = out = program.forward(program.batch(ids))
                sent_at[op.micro_batch] = time.perf_counter()
                computing += sent_at[op.micro_batch] - started
                sender.send(out, step, op.micro_batch, ids)
            else:
                grad = receiver.tensor(step, op.micro_batch)
                started = time.perf_counter()
                if self._dp is not None:  # each rank backpropagates the rows it produced
                    self._dp.backward(step, op.micro_batch, grad)
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
            self._size_window(receiver, step, sent_at, computing / cfg.micro_batches)

    def _size_window(
        self, receiver: ReceiveAhead, step: int, sent_at: dict[int, float], compute_s: float
    ) -> None:
        """The next step's 1F1B window from this step's measured gradient latency and compute.

        Latency per micro-batch = its gradient decoded and ready (the receive thread's clock)
        minus its activation handed to the sender; the smallest of the step is the one the
        downstream did not queue behind others (the round trip itself). On the serial path
        (no receive thread) a gradient's arrival is not seen apart from when the stage took it,
        which would only ever grow the window: the window stays at ``max_in_flight`` there.
        """
        arrived = receiver.arrivals(step)
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

    def _upstream_one_way_step(self, program: StageProgram, sender: AsyncSender, step: int) -> float:
        """Generator side: produce, send at once (the WAN overlaps the backward), train on the own loss."""
        micro_batches = self.spec.program.micro_batches
        total = 0.0
        for micro_batch in range(micro_batches):
            ids = self._ids(step, micro_batch)
            out, own = program.produce(program.batch(ids))
            sender.send(self._check_payload(out), step, micro_batch, ids)
            own = own / micro_batches
            own.backward()
            total += own.item()
        return total

    def _await_syncs(self, receiver: ReceiveAhead, start: int, step: int) -> None:
        """After ``step``: wait for the sync of ``step - sync_lag``; after the last step, for all left."""
        lag = self.spec.program.sync_lag
        last = self.spec.steps - 1
        due = range(step - lag, last + 1) if step == last else range(step - lag, step - lag + 1)
        for synced in due:
            if synced < start:
                continue
            receiver.expect_signal(SYNC, synced)
            values = receiver.signal(SYNC, synced)
            if len(values) != 1:
                raise EdgeClosedError(f"sync mismatch: step {synced} sync carries {values}, expected [loss]")

    def _check_payload(self, out: torch.Tensor) -> torch.Tensor:
        """What produce() returns must be the dtype the edge payload declares (int64 travels exactly)."""
        if not self._int_payload:
            if not out.is_floating_point():
                raise ProgramError(
                    f"produce() returned {out.dtype} but the edge payload is float (edges.0.payload: int64?)"
                )
            return out
        if out.dtype != torch.int64:
            raise ProgramError(f"the edge payload is int64 but produce() returned {out.dtype}")
        return out

    def _post_downstream_receives(self, receiver: ReceiveAhead, through: int) -> None:
        """Post the activations of every step up to ``through`` (within the job) not yet posted.

        The downstream posts one step ahead, so the next step's first activation is decoded
        while this step's last micro-batch and optimizer step compute.
        """
        cfg = self.spec.program
        for step in range(self._posted_through + 1, min(through, self.spec.steps - 1) + 1):
            for op in downstream_ops(cfg.micro_batches):
                if op.kind == "F":
                    receiver.expect_tensor(step, op.micro_batch, self._ids(step, op.micro_batch))
            self._posted_through = step

    def _downstream_step(
        self, program: StageProgram, receiver: ReceiveAhead, sender: AsyncSender, step: int
    ) -> float:
        cfg = self.spec.program
        backprop = not self._one_way
        total = 0.0
        self._post_downstream_receives(receiver, step + 1)
        for op in downstream_ops(cfg.micro_batches):
            if op.kind != "F":
                continue  # each micro-batch's backward is sent right after its forward, below
            ids = self._ids(step, op.micro_batch)
            received = receiver.tensor(step, op.micro_batch)
            if self._int_payload and received.dtype != torch.int64:
                raise EdgeClosedError(f"the edge payload is int64 but the peer sent {received.dtype}")
            if self._dp is not None:
                value, grad = self._dp.micro_batch(step, op.micro_batch, received, ids)
            else:
                memory = received.requires_grad_(True) if backprop else received
                loss = program.loss(memory, program.batch(ids)) / cfg.micro_batches
                loss.backward()
                value, grad = loss.item(), memory.grad
            if backprop:
                if grad is None:
                    raise ProgramError("loss() does not depend on the received tensor: no gradient to return")
                sender.send(grad, step, op.micro_batch, ids)
            total += value
        return total


__all__ = ["ProgramRunner"]
