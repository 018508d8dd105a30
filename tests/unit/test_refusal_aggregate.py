"""A stranger cannot multiply audit records: refusals are written once per source, layer and reason per
interval, repeats as one record with their count; the number of records per interval is bounded."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from nebula_common.audit.aggregate import RefusalAggregator, source_host


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Log:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def append(self, event: str, *, outcome: str, details: dict[str, Any]) -> None:
        with self._lock:
            self.records.append({"event": event, "outcome": outcome, **details})

    def total(self) -> int:
        return sum(r["count"] for r in self.records)


def test_the_first_refusal_is_written_at_once_and_a_flood_of_it_as_one_more_record() -> None:
    log, clock = Log(), Clock()
    refusals = RefusalAggregator(log.append, interval_s=60, clock=clock)
    refusals.refused("link.refused", "tls", "no certificate", {"address": "ipv4:203.0.113.9:40001"})
    assert log.records == [
        {
            "event": "link.refused",
            "outcome": "refused",
            "address": "ipv4:203.0.113.9:40001",
            "layer": "tls",
            "reason": "no certificate",
            "source": "203.0.113.9",
            "count": 1,
        }
    ]
    for port in range(99_999):  # every connection from another source port of the same host
        refusals.refused("link.refused", "tls", "no certificate", {"address": f"ipv4:203.0.113.9:{port}"})
    clock.now = 30.0
    refusals.tick()
    assert len(log.records) == 1  # the interval is not over
    clock.now = 61.0
    refusals.tick()
    assert len(log.records) == 2 and log.records[1]["count"] == 99_999 and log.total() == 100_000
    refusals.tick()
    assert len(log.records) == 2  # nothing new, nothing written


def test_records_per_interval_are_bounded_whatever_the_sources_and_reasons() -> None:
    log, clock = Log(), Clock()
    refusals = RefusalAggregator(log.append, interval_s=60, max_keys=64, clock=clock)
    sent = 0
    for source in range(1_000):
        for attempt in range(100):
            layer = ("tls", "handshake")[attempt % 2]
            refusals.refused(
                "link.refused",
                layer,
                f"garbage {attempt}",
                {"address": f"10.0.{source // 256}.{source % 256}:1"},
            )
            sent += 1
    refusals.flush()
    assert log.total() == sent == 100_000
    assert len(log.records) <= 2 * 64 + 2, len(log.records)
    assert {r["source"] for r in log.records if r["reason"] == "more refusals than tracked keys"} == {"*"}


def test_counts_are_exact_under_concurrent_refusals() -> None:
    log = Log()
    refusals = RefusalAggregator(log.append, interval_s=3600)

    def hammer(n: int) -> None:
        for _ in range(5_000):
            refusals.refused("link.refused", "identity", "not the peer", {"address": f"192.0.2.{n}:9"})

    threads = [threading.Thread(target=hammer, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive()
    refusals.flush()
    assert log.total() == 20_000 and len(log.records) == 8


@pytest.mark.parametrize(
    ("address", "host"),
    [
        ("ipv4:127.0.0.1:5000", "127.0.0.1"),
        ("ipv6:[::1]:5000", "::1"),
        ("198.51.100.7:443", "198.51.100.7"),
        ("[2001:db8::1]:443", "2001:db8::1"),
        (None, "unknown"),
        ("", "unknown"),
    ],
)
def test_the_source_is_the_host_without_its_port(address: object, host: str) -> None:
    assert source_host(address) == host


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        RefusalAggregator(Log().append, interval_s=0)
