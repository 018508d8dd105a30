"""A stage's edges within one attempt: opening them, the start barrier, tearing them down together.

Why a module of its own: how a stage meets the other cluster (its edge opens first, so a stage that
fails to start reaches the peer as an error close at once; a recovering stage keeps trying its switch;
no step starts before every stage is built) is the same whatever the stage computes, and separate
from the steps that use the edge.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from nebula_common.proto.nebula.v1 import relay_pb2, trainer_pb2
from services.trainer.edge import EdgeConnection, EdgeFactory, EdgeOutage, EdgeSettings
from services.trainer.runtime.lifecycle import StageLifecycle

log = logging.getLogger(__name__)
START_TIMEOUT_S = 600.0
"""How long a stage waits for the other cluster's stage to be ready (READY), or for its RESUME."""
OPEN_RETRY_S = 5.0
"""A recovering stage opens its edge in slices of at most this long, so a cancel ends it soon."""
READY = relay_pb2.SIGNAL_KIND_READY


def attempt_settings(settings: EdgeSettings, cfg: trainer_pb2.ProgramStage) -> EdgeSettings:
    """The edge settings of an attempt: a receive queue that holds what the stage's steps leave unread.

    one_way: the upstream holds up to sync_lag + 1 unread syncs while it keeps sending.
    """
    queue_items = max(2 * cfg.max_in_flight, cfg.sync_lag + 2) + 1
    return dataclasses.replace(settings, receive_queue_items=queue_items)


def abort_all(*edges: EdgeConnection) -> Callable[[str], None]:
    """One abort hook for a stage with several edges (a chain's middle): each is told and torn down."""

    def abort(reason: str) -> None:
        for edge in edges:
            edge.abort(reason)

    return abort


def open_edge(
    factory: EdgeFactory,
    spec: trainer_pb2.StageSpec,
    settings: EdgeSettings,
    epoch: int,
    lifecycle: StageLifecycle,
) -> EdgeConnection:
    """The attempt's edge (``spec``: the stage's, or a middle stage's view of one of its edges).

    A recovering stage whose switch does not answer (it is down too) keeps trying, without a
    deadline, in slices of at most ``OPEN_RETRY_S`` so a cancel ends it soon; the stage's status
    says it waits for its switch.
    """
    if epoch == 0:
        return factory(spec, settings, epoch)
    settings = dataclasses.replace(settings, ready_timeout_s=min(settings.ready_timeout_s, OPEN_RETRY_S))
    board = lifecycle.board
    told = False
    while True:
        lifecycle.raise_if_cancelled()
        try:
            return factory(spec, settings, epoch)
        except EdgeOutage as exc:
            if not told:
                waiting = f"{board.latest().message}; waiting for this cluster's switch"
                board.update(message=waiting)
                told = True
            log.warning(
                "recovering stage: switch did not answer; opening again",
                extra={"fields": {"job_id": spec.job_id, "epoch": epoch, "reason": str(exc)}},
            )


def start_barrier(
    spec: trainer_pb2.StageSpec, edge: EdgeConnection, upstream: bool, down: EdgeConnection | None = None
) -> None:
    """Start the first step only once the other cluster's stage is built and ready.

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
                "job_id": spec.job_id,
                "stage": spec.stage,
                "waited_for_peer_seconds": round(time.perf_counter() - started, 3),
            }
        },
    )


__all__ = [
    "OPEN_RETRY_S",
    "READY",
    "START_TIMEOUT_S",
    "abort_all",
    "attempt_settings",
    "open_edge",
    "start_barrier",
]
