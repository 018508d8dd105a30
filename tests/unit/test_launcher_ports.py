"""Service ports of a local deployment come from outside the kernel's ephemeral range (see ``ports.py``)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from nebula_common import ports
from nebula_common.ports import (
    FALLBACK_EPHEMERAL,
    HIGHEST_PORT,
    LOWEST_PORT,
    NoFreePortError,
    candidate_ranges,
    ephemeral_range,
    service_port,
)

pytestmark = pytest.mark.timeout(30)


def test_the_ephemeral_range_is_read_from_the_kernel_file(tmp_path: Path) -> None:
    path = tmp_path / "ip_local_port_range"
    path.write_text("40000\t50000\n")
    assert ephemeral_range(path) == (40000, 50000)
    for bad in ("", "1 2 3", "x y", "50000 40000", "0 10"):
        path.write_text(bad)
        assert ephemeral_range(path) == FALLBACK_EPHEMERAL, bad
    assert ephemeral_range(tmp_path / "missing") == FALLBACK_EPHEMERAL


def test_candidates_are_everything_above_the_floor_outside_the_range() -> None:
    assert candidate_ranges((32768, 60999)) == [range(LOWEST_PORT, 32768), range(61000, HIGHEST_PORT + 1)]
    assert candidate_ranges((1024, 65535)) == []
    assert candidate_ranges((5000, 20000)) == [range(20001, HIGHEST_PORT + 1)]


def test_ports_are_outside_the_live_ephemeral_range_distinct_and_bindable() -> None:
    low, high = ephemeral_range()
    ports = [service_port() for _ in range(40)]
    assert len(set(ports)) == len(ports)
    assert all(LOWEST_PORT <= p <= HIGHEST_PORT and not low <= p <= high for p in ports), ports
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))  # it was free when handed out, and nobody else took it


def _held_port() -> socket.socket:
    """A listening socket on a port the kernel chose (so no other process holds it)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_a_taken_port_is_skipped_and_none_left_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two candidates only, both ports this test holds (a fixed port such as 65535 may be held by any
    # other program on the machine): the bounds are narrowed to them and the "ephemeral range"
    # is everything in between, so the candidates are exactly {taken, free}.
    taken = _held_port()
    spares = [_held_port()]
    try:
        while abs(spares[-1].getsockname()[1] - taken.getsockname()[1]) < 2 and len(spares) < 5:
            spares.append(_held_port())  # adjacent: no port strictly between them for the range
        spare = spares[-1]
        low, high = sorted((taken.getsockname()[1], spare.getsockname()[1]))
        assert high - low >= 2, (low, high)
        monkeypatch.setattr(ports, "LOWEST_PORT", low)
        monkeypatch.setattr(ports, "HIGHEST_PORT", high)
        between = (low + 1, high - 1)
        free = spare.getsockname()[1]
        spare.close()  # now bindable; ``taken`` stays held
        assert service_port(ephemeral=between) == free
        with pytest.raises(NoFreePortError, match="after 50 tries"):
            service_port(attempts=50, ephemeral=between)  # ``free`` is handed out, ``taken`` held
    finally:
        taken.close()
        for sock in spares:
            sock.close()
    with pytest.raises(NoFreePortError, match="leaves no port"):
        service_port(ephemeral=(1024, HIGHEST_PORT))
