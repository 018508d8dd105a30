"""Two network namespaces joined by a veth pair, with ``tc tbf`` on demand: the kernel reference.

The emulator benchmark needs a shaper nobody wrote in Python: the kernel's token bucket filter on
a real interface. Namespaces keep it private: nothing on the shared machine's own interfaces or
loopback is touched, and :meth:`NetnsPair.close` deletes both namespaces (and with them the veth
pair and its qdisc) even when the benchmark fails half-way. Needs root and ``ip``/``tc`` (iproute2);
:func:`unavailable_reason` says in one line why not, so the benchmark can record a skip instead of a
traceback.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from types import TracebackType

# A link-local /30 far from anything Docker, k8s or the launcher use.
ADDRESS_A = "10.213.77.1"
ADDRESS_B = "10.213.77.2"
_PREFIX = 30


def _run(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {result.stderr.strip() or result.returncode}")


def unavailable_reason() -> str | None:
    """None when namespaces and tbf can be used here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the benchmark as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"nbw-probe-{os.getpid()}"
    try:
        _run(["ip", "netns", "add", probe])
    except RuntimeError as exc:
        return f"cannot create a network namespace: {exc}"
    try:
        _run(["ip", "-n", probe, "link", "set", "lo", "up"])
        _run(
            [
                "tc",
                "-n",
                probe,
                "qdisc",
                "add",
                "dev",
                "lo",
                "root",
                "tbf",
                "rate",
                "1mbit",
                "burst",
                "32k",
                "limit",
                "65536",
            ]
        )
    except RuntimeError as exc:
        return f"tc tbf does not work in a namespace here: {exc}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


class NetnsPair:
    """Namespaces ``<tag>-a`` and ``<tag>-b``; ``a`` reaches ``b`` at :data:`ADDRESS_B` over a veth pair.

    Shaping (:meth:`shape`) applies to ``a``'s egress only, i.e. to data sent from ``a`` to ``b``;
    acknowledgements travel back unshaped, as they would on a full-duplex circuit whose other
    direction is idle.
    """

    def __init__(self, tag: str | None = None) -> None:
        tag = tag or f"nbw{os.getpid()}"
        self.a = f"{tag}-a"
        self.b = f"{tag}-b"
        self._dev_a = f"{tag}va"[:15]
        self._dev_b = f"{tag}vb"[:15]
        self._created: list[str] = []

    def __enter__(self) -> NetnsPair:
        try:
            for ns in (self.a, self.b):
                _run(["ip", "netns", "add", ns])
                self._created.append(ns)
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(
                [
                    "ip",
                    "link",
                    "add",
                    self._dev_a,
                    "netns",
                    self.a,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    self._dev_b,
                    "netns",
                    self.b,
                ]
            )
            _run(["ip", "-n", self.a, "addr", "add", f"{ADDRESS_A}/{_PREFIX}", "dev", self._dev_a])
            _run(["ip", "-n", self.b, "addr", "add", f"{ADDRESS_B}/{_PREFIX}", "dev", self._dev_b])
            _run(["ip", "-n", self.a, "link", "set", self._dev_a, "up"])
            _run(["ip", "-n", self.b, "link", "set", self._dev_b, "up"])
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Delete both namespaces; their veth ends and qdiscs go with them."""
        while self._created:
            subprocess.run(["ip", "netns", "del", self._created.pop()], capture_output=True, check=False)

    def exec_argv(self, ns: str, argv: list[str]) -> list[str]:
        """``argv`` run inside namespace ``ns``."""
        return ["ip", "netns", "exec", ns, *argv]

    def shape(self, rate_bit: int, burst_bytes: int, limit_bytes: int) -> str:
        """Put ``tbf`` on a's egress; returns the exact ``tc`` command, for the report."""
        argv = [
            "tc", "-n", self.a, "qdisc", "replace", "dev", self._dev_a, "root", "tbf",
            "rate", f"{rate_bit}bit", "burst", str(burst_bytes), "limit", str(limit_bytes),
        ]  # fmt: skip
        _run(argv)
        return " ".join(argv)

    def unshape(self) -> None:
        """Back to the default qdisc (no shaping)."""
        subprocess.run(
            ["tc", "-n", self.a, "qdisc", "del", "dev", self._dev_a, "root"], capture_output=True, check=False
        )
