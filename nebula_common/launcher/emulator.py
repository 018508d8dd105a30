"""The WAN emulator of a local deployment as a supervised process, in front of a switch's WAN port.

Started through the ``wan`` command group alone (``nebula``'s other commands import torch), on ports
picked like the services' and retried on new ones when another process took one first.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

from nebula_common.launcher.pinned import BIND_ATTEMPTS, BIND_FAILURE, LOOPBACK, START_TIMEOUT_S
from nebula_common.launcher.process import ServiceProcess, ServiceStartError, console_command
from nebula_common.ports import service_port

__all__ = ["launch_emulator", "wait_listening"]


def launch_emulator(
    name: str,
    acceptor_wan: int,
    bandwidth_mbit: float,
    delay_ms: float,
    control_token_file: Path,
    log_dir: Path,
) -> tuple[ServiceProcess, int, int]:
    """Start the emulator; (its process, its port, its control port).

    A port free when chosen can be taken by another process before the emulator binds it (other
    test runs share the machine); like the services (``BIND_ATTEMPTS``), it is retried on new ports.
    """
    for attempt in range(1, BIND_ATTEMPTS + 1):
        emulator_port = service_port()
        control_port = service_port()
        emulator = ServiceProcess(
            name=name,
            command=console_command(
                "nebula_common.cli.wan",
                "emulate",
                "--listen",
                f"{LOOPBACK}:{emulator_port}",
                "--target",
                f"{LOOPBACK}:{acceptor_wan}",
                "--bandwidth-mbit",
                str(bandwidth_mbit),
                "--delay-ms",
                str(delay_ms),
                "--control",
                f"{LOOPBACK}:{control_port}",
                "--control-token-file",
                str(control_token_file),
            ),
            env={},
            log_dir=log_dir,
            ready_probe=lambda port=emulator_port: _listening(port),
        )
        emulator.start()
        try:
            wait_listening(emulator, emulator_port)
            wait_listening(emulator, control_port)
        except ServiceStartError as exc:
            emulator.stop()
            if attempt < BIND_ATTEMPTS and BIND_FAILURE.search(str(exc)):
                continue
            raise
        except BaseException:
            emulator.stop()
            raise
        return emulator, emulator_port, control_port
    raise AssertionError("unreachable: the last attempt returns or raises")


def wait_listening(process: ServiceProcess, port: int, timeout: float = START_TIMEOUT_S) -> None:
    """Until ``process`` accepts on ``port``; ``ServiceStartError`` with its log's tail if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.popen is not None and process.popen.poll() is not None:
            raise ServiceStartError(f"{process.name} exited during start-up:\n{process.tail()}")
        if _listening(port):
            return
        time.sleep(0.05)
    raise ServiceStartError(f"{process.name} not listening on {port} within {timeout:.0f}s")


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex((LOOPBACK, port)) == 0
