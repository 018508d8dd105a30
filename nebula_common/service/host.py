"""Start, run, drain and stop any Nebula service the same way.

A service is a ``ServiceDefinition``: its name, its settings class and one
``start(settings, stack)`` coroutine that acquires resources in order and
registers each one's cleanup on ``stack`` as soon as it holds it. Everything
else is here, once:

* ``start_service`` runs ``start`` and, if it fails or is cancelled half-way,
  unwinds what was already acquired (last in, first out);
* ``serve`` prints the one JSON ready line launchers read, runs until SIGINT or
  SIGTERM, and then unwinds the stack (health NOT_SERVING, drain calls, stop
  background work, seal the audit log), also when the signal arrives during
  start-up;
* ``run_service_main`` is every console entry point: configuration errors exit 2
  naming the environment variable, runtime errors exit 1 with one clear line,
  a signal at any moment exits 0. Once the service has stopped, the process ends at
  once (``os._exit`` after flushing), without the interpreter's teardown.

This module imports nothing heavy at import time: the entry point installs its
signal handlers before torch or gRPC load.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, NoReturn, TypeVar

from nebula_common.stop_signals import unblock_stop_signals

if TYPE_CHECKING:
    from nebula_common.service.settings import ServiceSettings

log = logging.getLogger(__name__)

S = TypeVar("S", bound="ServiceSettings")
H = TypeVar("H")
T = TypeVar("T")

EXIT_JOIN_S = 10.0
"""How long a stopped service waits for its remaining non-daemon threads before it exits anyway
(within the launcher's 15 s before SIGKILL, so the log says which thread held it)."""
EXIT_OK = 0
EXIT_RUNTIME_ERROR = 1
EXIT_CONFIG_ERROR = 2

# What must run before ``os._exit`` skips the interpreter's exit (and with it ``atexit``).
_before_process_end: list[Callable[[], object]] = []


def before_process_end(callback: Callable[[], object]) -> None:
    """Run ``callback`` when a service's process ends, after the last log line and before ``os._exit``.

    ``atexit`` is not run (the process skips the interpreter's teardown, see ``run_service_main``);
    a service that rewired a file descriptor (the switch's stderr tap) restores it here. Callbacks
    run last in, first out; an exception in one is ignored so the process still ends with its code.
    """
    _before_process_end.append(callback)


@dataclass
class Started(Generic[H]):
    """What a service's ``start`` hands back: an in-process handle and the ports to announce."""

    handle: H
    ports: dict[str, int | str | None]
    """Ports to announce (``*_port``), and any other fact of the running service an operator must see
    (the trainer's ``stage_isolation``)."""


@dataclass(frozen=True)
class ServiceDefinition(Generic[S, H]):
    """A service as the skeleton sees it (see the module docstring)."""

    name: str
    settings: type[S]
    start: Callable[[S, contextlib.AsyncExitStack], Awaitable[Started[H]]]
    on_serve: Callable[[H], object] | None = None
    """Process-wide set-up that only the service's own process may do (never in-process tests)."""


@dataclass
class RunningService(Generic[H]):
    """A started service; ``stop`` unwinds everything ``start`` acquired, in reverse order."""

    name: str
    cluster_id: str
    handle: H
    ports: dict[str, int | str | None]
    _stack: contextlib.AsyncExitStack = field(repr=False)

    def announcement(self) -> dict[str, Any]:
        """The ready line: service, cluster and ports (``grpc_port``, ``metrics_port``, ...)."""
        return {"service": self.name, "cluster_id": self.cluster_id, **self.ports}

    async def stop(self) -> None:
        await self._stack.aclose()


async def start_service(definition: ServiceDefinition[S, H], settings: S) -> RunningService[H]:
    """Run ``definition.start``; on failure or cancellation, release what it had acquired first."""
    stack = contextlib.AsyncExitStack()
    try:
        started = await definition.start(settings, stack)
    except BaseException:
        await stack.aclose()
        raise
    return RunningService(definition.name, settings.cluster_id, started.handle, started.ports, stack)


async def acquire_in_thread(
    stack: contextlib.AsyncExitStack, open_: Callable[[], T], close: Callable[[T], object]
) -> T:
    """Open a blocking resource in a worker thread and register its ``close`` on ``stack``.

    A worker thread cannot be interrupted, so a stop that arrives during the open
    waits for it to finish and then closes what it opened (an audit log left
    unsealed, a database left open) before letting the cancellation through.
    """
    opening = asyncio.ensure_future(asyncio.to_thread(open_))
    try:
        resource = await asyncio.shield(opening)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            opened = await opening
            await asyncio.to_thread(close, opened)
        raise
    stack.push_async_callback(asyncio.to_thread, close, resource)
    return resource


async def serve(
    definition: ServiceDefinition[S, H], settings: S, *, early_signals: list[int] | None = None
) -> RunningService[H] | None:
    """Start, announce, run until SIGINT/SIGTERM, then stop.

    Returns what ran, or None when the stop came during start-up.
    """
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    if early_signals:  # caught by run_service_main's handler before the loop's replaced it
        stopping.set()
    log.info("starting", extra={"fields": {"service": definition.name, "cluster_id": settings.cluster_id}})
    starting = asyncio.create_task(start_service(definition, settings), name=f"start-{definition.name}")
    stop_wait = asyncio.create_task(stopping.wait(), name="stop-signal")
    try:
        await asyncio.wait({starting, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            log.info("stop requested during start-up")
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting  # start_service unwinds what was acquired
            return None
        running = starting.result()  # a start-up error propagates from here, nothing left behind
        if definition.on_serve is not None:
            definition.on_serve(running.handle)
        sys.stdout.write(json.dumps(running.announcement()) + "\n")
        sys.stdout.flush()
        log.info("serving", extra={"fields": running.announcement()})
        try:
            await stop_wait
            log.info("stopping")
        finally:
            await running.stop()
        log.info("stopped")
        return running
    finally:
        stop_wait.cancel()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


def run_service_main(name: str, definition_ref: str) -> NoReturn:
    """Every service's console entry point; ends the process with its exit code.

    ``definition_ref`` is ``"module:attribute"`` of the ``ServiceDefinition``. It is
    imported only after SIGINT/SIGTERM handlers are in place: a signal during that
    (seconds-long, longer on a loaded host) import of torch and gRPC ends the process at
    once with exit 0, since nothing is acquired yet; one between the import and the
    event loop is remembered and honoured with exit 0 before anything starts.

    When ``_run`` returns, the service's stack has unwound: every file is closed, the audit log
    sealed, every server and thread of ours stopped. What Python would still do at exit is tear
    down torch, gRPC and every module, which took 4-8 s per process under load (trainer, switch,
    codec), the larger part of a deployment's stop. So the process ends here, after flushing.
    """
    signals: list[int] = []
    importing = True

    def remember(signum: int, _frame: object) -> None:
        if importing:  # no file, port or thread of ours exists yet: nothing to unwind
            os._exit(EXIT_OK)
        signals.append(signum)

    def imported() -> None:
        nonlocal importing
        importing = False

    previous = {signum: signal.signal(signum, remember) for signum in (signal.SIGINT, signal.SIGTERM)}
    unblock_stop_signals()  # the launcher starts services with them blocked: one that came early arrives now
    try:
        code = _run(name, definition_ref, signals, imported)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    _end_process(code)


def _end_process(code: int) -> NoReturn:
    """``os._exit(code)`` once what Python's exit would wait for is done, and logs are flushed.

    That is: threads that are not daemons are joined (as the interpreter does first), and child
    processes (a trainer's ranks) are ended as ``multiprocessing``'s exit hook does: daemonic
    ones terminated, then all joined. Module teardown, the slow part, is what is skipped.
    """
    current = threading.current_thread()
    deadline = time.monotonic() + EXIT_JOIN_S
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():  # an idle pool's worker waits forever; a stop must not
                log.warning("thread %r still running after the stop; exiting without it", thread.name)
    if "multiprocessing" in sys.modules:
        import multiprocessing

        children = multiprocessing.active_children()
        for child in children:
            if child.daemon:
                child.terminate()
        for child in children:
            child.join()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    while _before_process_end:
        with contextlib.suppress(Exception):
            _before_process_end.pop()()
    os._exit(code)


def _run(name: str, definition_ref: str, signals: list[int], imported: Callable[[], None]) -> int:
    from pydantic import ValidationError

    from nebula_common.errors import NebulaError
    from nebula_common.logging import configure_logging
    from nebula_common.service.settings import describe_validation_error, unknown_variables

    module_name, _, attribute = definition_ref.partition(":")
    definition: ServiceDefinition[Any, Any] = getattr(importlib.import_module(module_name), attribute)
    imported()
    unknown = unknown_variables(definition.settings, os.environ)
    if unknown:
        sys.stderr.write(
            f"nebula-{name}: invalid configuration: "
            + "; ".join(f"{variable}: not a setting of this service" for variable in unknown)
            + " (docs/settings.md lists them)\n"
        )
        return EXIT_CONFIG_ERROR
    try:
        settings = definition.settings()
    except ValidationError as exc:
        sys.stderr.write(
            f"nebula-{name}: invalid configuration: {describe_validation_error(definition.settings, exc)}\n"
        )
        return EXIT_CONFIG_ERROR
    configure_logging(name, settings.log_level)
    if signals:
        log.info("stop requested before start-up")
        return EXIT_OK
    try:
        asyncio.run(serve(definition, settings, early_signals=signals))
    except (OSError, RuntimeError, ValueError, TimeoutError, NebulaError) as exc:
        # Expected failures (a port taken, auth unreachable, a bad certificate): one clear line.
        log.error("%s service failed: %s", name, exc, extra={"fields": {"error": str(exc)}})
        return EXIT_RUNTIME_ERROR
    except Exception as exc:
        log.exception("%s service crashed: %s", name, exc)
        return EXIT_RUNTIME_ERROR
    return EXIT_OK
