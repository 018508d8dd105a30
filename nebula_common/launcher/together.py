"""Start independent parts of a deployment at the same time, and report their first failure.

A service's start is mostly its own process's CPU (imports, keys, torch's first use): one after another,
a two-cluster deployment used one core of two for about 20 s. Parts that need nothing of each other
(the clusters' core services, a cluster's codec and data, the trainers) start together here.

Every part runs to its end before this returns or raises, so a caller that stops what was started after
a failure finds each process either in its state or already stopped by the part that failed; an
interrupt (Ctrl-C) while parts are starting is re-raised once they have.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

__all__ = ["start_together"]


def start_together(parts: Sequence[Callable[[], None]], name: str = "start") -> None:
    """Run ``parts`` at once (one thread each); raise the first part's exception once all have ended."""
    if len(parts) == 1:
        parts[0]()
        return
    errors: list[BaseException | None] = [None] * len(parts)

    def run(index: int) -> None:
        try:
            parts[index]()
        except BaseException as exc:  # handed to the caller below, whatever it was
            errors[index] = exc

    threads = [
        threading.Thread(target=run, args=(index,), name=f"{name}-{index}", daemon=True)
        for index in range(len(parts))
    ]
    for thread in threads:
        thread.start()
    interrupted: BaseException | None = None
    for thread in threads:
        while thread.is_alive():
            try:
                thread.join()
            except BaseException as exc:  # Ctrl-C: let every part finish, so none is left half-started
                interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted
    for error in errors:
        if error is not None:
            raise error
