"""A stage driver's cluster ranks from inside its box: asked of its trainer over the stage channel.

A stage on the cluster's ranks is driven from its own stage process (``stage_main``), which holds no
key and cannot reach the rank store. ``BoxedRanks`` stands there where ``ClusterRanks`` stands for a
driver in the trainer (``stage_placement``): ``attach`` asks the trainer to post this attempt of the
stage (naming only the checkpoint it resumes) and returns ``BoxedAttached``, whose store is that
stage's keys through the trainer's bridge (``store_bridge``) and whose ``why``, ``finish`` and
``abort`` the trainer does (``services/trainer/stage_ranks``): it holds the rank store and reads the
ranks' heartbeats.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any

from nebula_common.proto.nebula.v1 import trainer_pb2
from services.trainer.runtime.rank_sources import JOIN_TIMEOUT_S, WHY_WAIT_S
from services.trainer.runtime.replica_compute import DataParallelError
from services.trainer.runtime.store_bridge import BridgedStore

ATTACH_TIMEOUT_S = JOIN_TIMEOUT_S + 60.0
"""How long the driver waits for its ranks (the trainer waits ``JOIN_TIMEOUT_S`` for them to join)."""
WHY_TIMEOUT_S = WHY_WAIT_S + 30.0


class RanksAsker:
    """Requests to the trainer (``send``) and their answers (``answer``, from the channel's reader),
    one request at a time; each answer carries its request's id, so a late one is never taken for
    the next's."""

    def __init__(self, send: Callable[[dict[str, Any]], None]) -> None:
        self._send = send
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def answer(self, body: dict[str, Any] | None) -> None:
        """An answer of the trainer; None: the channel is closed (every wait ends now)."""
        self._answers.put(body)

    def ask(self, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        with self._lock:
            request = next(self._ids)
            self._send({**body, "id": request})
            while True:
                try:
                    answer = self._answers.get(timeout=timeout)
                except queue.Empty:
                    raise DataParallelError(
                        f"the trainer did not answer {body['op']} for the cluster's ranks "
                        f"within {timeout:.0f} s"
                    ) from None
                if answer is None:
                    self._answers.put(None)  # for any later request too
                    raise DataParallelError("the trainer closed the stage channel")
                if answer.get("id") == request:
                    break
        if "error" in answer:
            said = answer["error"]
            raise DataParallelError(f"the trainer could not {body['op']} the cluster's ranks: {said}")
        return answer

    def tell(self, body: dict[str, Any]) -> None:
        """A request that has no answer (``abort``): never behind a request waiting for its answer (a
        cancel comes from the channel's reader, which must go on reading that answer)."""
        self._send(body)


class BoxedAttached:
    """The cluster's ranks while they run one attempt of this stage (``rank_group.Ranks``)."""

    def __init__(self, asker: RanksAsker, world: int, store: BridgedStore) -> None:
        self._asker = asker
        self.world = world
        self.store = store
        self._released = False

    def why(self, exc: BaseException) -> str:
        """The trainer's reading of the ranks (it sees their heartbeats); the error alone if it cannot."""
        said = f"{type(exc).__name__}: {exc}"
        try:
            return str(self._asker.ask({"op": "why", "error": said}, WHY_TIMEOUT_S)["why"])
        except (DataParallelError, KeyError, OSError):
            return said

    def finish(self, timeout: float) -> None:
        self._asker.ask({"op": "finish", "timeout": timeout}, timeout + 30.0)

    def abort(self) -> None:
        if not self._released:
            self._released = True
            # OSError: the trainer is gone, and freed them (or will, when it starts again).
            with contextlib.suppress(OSError):
                self._asker.tell({"op": "abort"})


class BoxedRanks:
    """The cluster's ranks as a boxed driver gets them (``stage_placement.rank_processes``)."""

    def __init__(
        self, asker: RanksAsker, world: int, store: BridgedStore, spec: trainer_pb2.StageSpec
    ) -> None:
        self._asker = asker
        self.world = world
        self._store = store
        self._spec = spec
        self._hosts: list[str] = []

    def attach(self, spec_bytes: bytes, owner: str) -> BoxedAttached:
        """Ask the trainer to post this attempt: the stage's own spec, or its resume from a checkpoint of
        its own (``resume.resumed_spec``), which is all the trainer will post for it."""
        attempt = trainer_pb2.StageSpec.FromString(spec_bytes)
        resume = None if attempt == self._spec else int(attempt.program.resume_step)
        answer = self._asker.ask({"op": "attach", "resume_step": resume}, ATTACH_TIMEOUT_S)
        self._hosts = [str(host) for host in answer.get("hosts", [])]
        return BoxedAttached(self._asker, int(answer["world"]), self._store)

    def joined(self) -> list[dict[str, object]]:
        """The hosts of the ranks the last attach got, as ``ClusterRanks.joined`` names them."""
        return [{"host": host} for host in self._hosts]


__all__ = ["ATTACH_TIMEOUT_S", "BoxedAttached", "BoxedRanks", "RanksAsker"]
