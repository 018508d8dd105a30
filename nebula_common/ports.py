"""Service ports for a local deployment, chosen outside the kernel's ephemeral port range.

A port the kernel hands out for ``bind(0)`` comes from ``net.ipv4.ip_local_port_range``, the same
range it draws the local ports of *outgoing* connections from. Every process of a deployment
(and every other program on the machine) keeps opening connections, so once a service dies its
old port is free for any of them to take as a source port; the supervisor's restart on that port
then fails with "address already in use", and the peers that know the old address never find the
service again. So the launcher picks every listening port itself, from outside that range, and
keeps it for the service's whole life (the restart reuses it: ``local.py`` pins it in the env).

A port is chosen at random among the candidates (so concurrent deployments rarely try the same
one), must accept a bind on the loopback address at the time of choosing, and is never handed out
twice by one process. That still leaves a window between the check and the service's own bind,
in which another program could take it: the launcher then retries the start with new ports
(``LocalDeployment._launch``).

The trainer's rank store takes its port here too: a rank's box may connect only to ports inside the
ephemeral range, where its ranks' gloo and NCCL listen (``services/trainer/rank_box.py``), so a store
outside it is out of the box's reach even on the trainer's own host.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Used when the kernel does not say (not Linux): Linux's default and IANA's dynamic range together.
FALLBACK_EPHEMERAL = (32768, 65535)
LOWEST_PORT = 10000  # below: well-known and commonly registered services
HIGHEST_PORT = 65535
BIND_HOST = "127.0.0.1"

_handed_out: set[int] = set()
_lock = threading.Lock()
_random = random.SystemRandom()


class NoFreePortError(RuntimeError):
    """No port outside the ephemeral range could be bound."""


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral (outgoing source) port range, inclusive."""
    try:
        low, high = (int(part) for part in path.read_text().split())
    except (OSError, ValueError):
        return FALLBACK_EPHEMERAL
    return (low, high) if 0 < low <= high <= HIGHEST_PORT else FALLBACK_EPHEMERAL


def candidate_ranges(ephemeral: tuple[int, int]) -> list[range]:
    """The port ranges a service may listen on: above LOWEST_PORT and outside ``ephemeral``."""
    low, high = ephemeral
    ranges = [
        range(LOWEST_PORT, min(low, HIGHEST_PORT + 1)),
        range(max(high + 1, LOWEST_PORT), HIGHEST_PORT + 1),
    ]
    return [r for r in ranges if len(r)]


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((BIND_HOST, port))
        except OSError:
            return False
    return True


def service_port(attempts: int = 500, ephemeral: tuple[int, int] | None = None) -> int:
    """A port outside the ephemeral range, bindable now and not handed out before by this process."""
    ranges = candidate_ranges(ephemeral or ephemeral_range())
    total = sum(len(r) for r in ranges)
    if not total:
        raise NoFreePortError(
            f"the ephemeral port range {ephemeral or ephemeral_range()} leaves no port in "
            f"{LOWEST_PORT}..{HIGHEST_PORT} for services; narrow {EPHEMERAL_RANGE_FILE}"
        )
    for _ in range(attempts):
        index = _random.randrange(total)
        for candidates in ranges:
            if index < len(candidates):
                port = candidates[index]
                break
            index -= len(candidates)
        with _lock:
            if port in _handed_out:
                continue
            if _bindable(port):
                _handed_out.add(port)
                return port
    raise NoFreePortError(f"no bindable port outside the ephemeral range after {attempts} tries")


__all__ = ["NoFreePortError", "candidate_ranges", "ephemeral_range", "service_port"]
