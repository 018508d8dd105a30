"""Supervising a running stage process: reading its channel, mirroring its board, its deadline.

Why a module of its own: everything the stage process says is untrusted (it runs a tenant's code),
so what the trainer takes from it should be read in one place. It mirrors the stage's status board
(every status, in order, made this stage's whatever it says, one end only), stores each epoch
before the stage may open it (``on_epoch``, then EPOCH_OK), puts each step on ``/metrics`` and hands a
driver's requests for the cluster's ranks to ``stage_ranks``. A
message the protocol does not allow ends the stage, as does a channel closed by the stage or a
kill deadline passed: a cancel (``CANCEL_GRACE_S``) or a posted end (``ENDED_GRACE_S``) that the
process did not follow by exiting.

``StageSupervision`` is one part of ``StageProcess`` (``stage_process``), whose ``__init__`` sets
the state used here; its end is ``stage_end``'s.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from google.protobuf.message import DecodeError

from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer import stage_channel as channel
from services.trainer.metrics import record_step
from services.trainer.stage_ranks import StageRanks
from services.trainer.status import TERMINAL_STATES, StatusBoard

ENDED_GRACE_S = 2.0
"""How long a stage process that posted its end may take to exit (its edge's close going out)."""


class StageSupervision:
    """The channel's messages and the kill deadline of a running stage (part of ``StageProcess``)."""

    # Set by StageProcess.__init__ or provided by its other parts (annotations only).
    spec: trainer_pb2.StageSpec
    epoch: int
    board: StatusBoard
    _on_epoch: Callable[[int], None] | None
    _send_lock: threading.Lock
    _conn: Connection | None
    _kill_at: float | None
    _cancelled: bool
    _finish: Callable[[str], None]  # stage_end
    _ranks: StageRanks | None

    def _send(self, kind: bytes, payload: bytes = b"") -> None:
        conn = self._conn
        if conn is None:
            return
        with self._send_lock, contextlib.suppress(OSError, ValueError):  # it is gone: its end is near
            channel.send(conn, kind, payload)

    def _deadline(self, seconds: float) -> None:
        at = time.monotonic() + seconds
        if self._kill_at is None or at < self._kill_at:
            self._kill_at = at

    def _supervise(self) -> None:
        reason = ""
        conn = self._conn
        assert conn is not None
        try:
            while True:
                wait = None if self._kill_at is None else max(0.0, self._kill_at - time.monotonic())
                if not conn.poll(wait if wait is not None else 1.0):
                    if self._kill_at is not None and time.monotonic() >= self._kill_at:
                        reason = "it did not end in time after it was cancelled or ended"
                        break
                    continue
                self._handle(*channel.receive(conn))
        except EOFError:
            pass
        except (channel.ChannelError, DecodeError, ValueError, KeyError, TypeError) as exc:
            reason = f"it broke the stage channel protocol: {exc}"
        finally:
            self._finish(reason)

    def _handle(self, kind: bytes, payload: bytes) -> None:
        if kind == channel.STATUS:
            status = trainer_pb2.StageStatus.FromString(payload)
            status.job_id, status.stage = self.spec.job_id, self.spec.stage  # its own, whatever it says
            if self.board.finished:
                return  # one end only
            if self._cancelled and status.state == trainer_pb2.STAGE_STATE_SUCCEEDED:
                status.state = trainer_pb2.STAGE_STATE_CANCELLED
            self.board.publish(status)
            if status.state in TERMINAL_STATES:
                self._deadline(ENDED_GRACE_S)
        elif kind == channel.STEP:
            body = channel.parse_json(payload)
            loss = body.get("loss")
            record_step(
                self.spec.job_id,
                self.spec.stage,
                float(body["elapsed"]),
                float(body["waited"]),
                None if loss is None else float(loss),
            )
        elif kind == channel.EPOCH:
            epoch = int(channel.parse_json(payload)["epoch"])
            if epoch < self.epoch:
                raise ValueError(f"epoch {epoch} is older than {self.epoch}")
            self.epoch = epoch
            if self._on_epoch is not None:
                self._on_epoch(epoch)
            self._send(channel.EPOCH_OK)
        elif kind == channel.RANKS and self._ranks is not None:
            self._ranks.handle(channel.parse_json(payload))
        else:
            raise ValueError(f"unknown message kind {kind!r}")


__all__ = ["ENDED_GRACE_S", "StageSupervision"]
