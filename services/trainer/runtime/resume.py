"""Where a recovering stage restarts: the checkpoint step every stage of the job holds.

Recovery (relay.proto, "Epochs"; the attempts themselves are ``stage.py``'s): in a new epoch both
stages exchange RESUME signals listing the checkpoint steps they hold, and both restart from the
highest step in both lists (none: the job's own starting state), deleting their checkpoints of later
steps (they belong to the void attempt). Why a module of its own: this is the one exchange of a new
epoch that must end the same in every cluster, and the one place a restarted stage may conclude that
the job had already finished.
"""

from __future__ import annotations

import logging

from nebula_common.proto.nebula.v1 import relay_pb2, trainer_pb2
from services.trainer.edge import EdgeClosedError, EdgeConnection, EdgeTimeout
from services.trainer.runtime.stage_edges import START_TIMEOUT_S
from services.trainer.status import StatusBoard

log = logging.getLogger(__name__)
PEER_FINISHED_AFTER_S = 60.0
"""A restarted stage that holds its final checkpoint and hears no RESUME for this long (link up)
concludes the other cluster's stage had already finished (see ``PeerAlreadyFinished``)."""
RESUME = relay_pb2.SIGNAL_KIND_RESUME


class PeerAlreadyFinished(Exception):
    """A recovering stage that had done all its steps found its peer gone: the job had finished.

    A stage ends its last step only once it has everything the other stage sends for it, and it
    checkpoints then; if its trainer is killed after that (e.g. while closing the edge) and the other
    stage, which had all it needed, finished meanwhile, nobody will ever answer its RESUME. Waiting
    START_TIMEOUT_S and failing would report a finished job as failed.
    """


def exchange_resume(
    spec: trainer_pb2.StageSpec,
    held: list[int],
    edges: list[EdgeConnection],
    epoch: int,
    board: StatusBoard,
) -> int | None:
    """First items of a new epoch: the checkpoint steps every stage holds; the common step (or None).

    ``held``: this stage's checkpoint steps. Waits for the link first, without a deadline (the WAN
    may be down for long; a cancel aborts the edge and ends the wait). Each round, a stage sends the
    steps it knows to be held by every stage it has heard of to each neighbour (``edges``: one, or a
    middle's two), then takes theirs: after ``stages - 1`` rounds every stage of the chain knows the
    steps all of them hold (two stages: one round, each sends its own list). Every stage sends before
    it receives, so no stage waits for one that waits for it.
    """
    for edge in edges:
        if not edge.session.link_up:
            board.update(message=f"{board.latest().message}; waiting for the WAN link")
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


def resumed_spec(spec: trainer_pb2.StageSpec, common: int) -> trainer_pb2.StageSpec:
    """``spec`` restarting from its own checkpoint of step ``common`` (its replicas load the same)."""
    start_spec = trainer_pb2.StageSpec()
    start_spec.CopyFrom(spec)
    start_spec.program.ClearField("initial_state")
    start_spec.program.ClearField("initial_step")
    start_spec.program.resume_job_id = spec.job_id
    start_spec.program.resume_step = common
    return start_spec


def conclude_finished(spec: trainer_pb2.StageSpec, edges: list[EdgeConnection], board: StatusBoard) -> None:
    """End a restarted stage that found the job finished (``PeerAlreadyFinished``): its edges shut
    without telling a peer that is gone, and its status says all its steps were done, and why."""
    for end in edges:
        end.session.fail("finished", tell_peer=False)
    board.update(
        state=trainer_pb2.STAGE_STATE_RUNNING,
        steps_done=spec.steps,
        message=f"all {spec.steps} steps were done before this attempt; the other cluster's "
        f"stage had finished (no RESUME in {PEER_FINISHED_AFTER_S:.0f} s)",
    )


__all__ = [
    "PEER_FINISHED_AFTER_S",
    "RESUME",
    "PeerAlreadyFinished",
    "conclude_finished",
    "exchange_resume",
    "resumed_spec",
]
