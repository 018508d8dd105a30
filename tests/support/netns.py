"""Network namespaces as hosts for the two-host tests (``test_netns_orgs``, ``test_netns_ranks``).

Needs root and iproute2; the tests skip without them. Every name a test passes carries its process id,
so two runs side by side do not collide, and ``namespaces`` deletes what it created (which drops the
veths moved into them) however the test ends.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator


def run_ip(*args: str) -> str:
    """Run one iproute2 (or other) command; its stdout, or an AssertionError naming it and its stderr."""
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


@contextlib.contextmanager
def namespaces(*names: str) -> Iterator[None]:
    """Network namespaces ``names``, each with its loopback up; deleted on the way out."""
    created: list[str] = []
    try:
        for netns in names:
            run_ip("ip", "netns", "add", netns)
            created.append(netns)
            run_ip("ip", "-n", netns, "link", "set", "lo", "up")
        yield
    finally:
        for netns in created:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=30)  # drops its veths


def veth_between(*ends: tuple[str, str, str]) -> None:
    """A veth pair joining two namespaces: each end ``(netns, device, address/prefix)`` moved in and up."""
    (_, first, _), (_, second, _) = ends
    run_ip("ip", "link", "add", first, "type", "veth", "peer", "name", second)
    for netns, device, address in ends:
        run_ip("ip", "link", "set", device, "netns", netns)
        run_ip("ip", "-n", netns, "addr", "add", address, "dev", device)
        run_ip("ip", "-n", netns, "link", "set", device, "up")


def veth_to_us(netns: str, inner: str, inner_address: str, outer: str, outer_address: str) -> None:
    """A veth pair from our namespace into ``netns``: ``inner`` inside it, ``outer`` ours, both up."""
    run_ip("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
    run_ip("ip", "link", "set", inner, "netns", netns)
    run_ip("ip", "-n", netns, "addr", "add", inner_address, "dev", inner)
    run_ip("ip", "-n", netns, "link", "set", inner, "up")
    run_ip("ip", "addr", "add", outer_address, "dev", outer)
    run_ip("ip", "link", "set", outer, "up")
