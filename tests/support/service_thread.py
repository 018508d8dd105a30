"""Any Nebula service started in-process, the way its own process starts it, on a private loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Generic, TypeVar

from nebula_common.service.host import RunningService, ServiceDefinition, start_service

H = TypeVar("H")


class ServiceThread(Generic[H]):
    """``start_service`` on an event loop in a daemon thread; ``stop`` runs the service's ordered cleanup."""

    def __init__(self, definition: ServiceDefinition[Any, H], settings: Any, timeout: float = 60.0) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        try:
            self.service: RunningService[H] = asyncio.run_coroutine_threadsafe(
                start_service(definition, settings), self._loop
            ).result(timeout=timeout)
        except BaseException:
            self._shutdown_loop()
            raise

    @property
    def handle(self) -> H:
        return self.service.handle

    @property
    def address(self) -> str:
        """``127.0.0.1:<grpc port>`` of services with one gRPC port."""
        return f"127.0.0.1:{self.service.ports['grpc_port']}"

    def stop(self, timeout: float = 30.0) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.service.stop(), self._loop).result(timeout=timeout)
        finally:
            self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
