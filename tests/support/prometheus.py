"""A real Prometheus server (the Debian ``prometheus`` binary) scraping a local deployment, for tests.

Why a real one: the dashboard is PromQL evaluated by Prometheus over scraped series. Checking only
that metric names appear on ``/metrics`` misses wrong label names, a ``_total`` suffix, a histogram
without ``_bucket`` or a ratio that is always empty; evaluating each query in Prometheus does not.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from nebula_common.launcher.monitoring import ScrapeTarget, prometheus_config
from nebula_common.ports import service_port

REQUIRE_ENV = "NEBULA_REQUIRE_PROMETHEUS"  # set by .ci/run and `make check-dashboards`: absent = failure


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


class Prometheus:
    """HTTP API client of a running server: target health and PromQL range queries."""

    def __init__(self, base_url: str, process: subprocess.Popen[bytes], log: Path) -> None:
        self.base_url = base_url
        self.process = process
        self.log = log

    def _get(self, path: str, **params: Any) -> Any:
        url = f"{self.base_url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as exc:  # a PromQL error is a 400 with a JSON body
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise AssertionError(f"Prometheus {path} {params}: {body.get('error', body)}")
        return body["data"]

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"prometheus exited ({self.process.returncode}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"prometheus not ready within {timeout_s:.0f}s:\n{self.log_tail()}")
            time.sleep(0.2)

    def wait_targets_up(self, expected: int, timeout_s: float) -> None:
        """Every configured target scraped successfully at least once."""
        deadline = time.monotonic() + timeout_s
        while True:
            active = self._get("/api/v1/targets", state="active")["activeTargets"]
            down = [
                f"{t['scrapeUrl']} ({t['health']}: {t['lastError']})" for t in active if t["health"] != "up"
            ]
            if len(active) == expected and not down:
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{expected - len(active) + len(down)} of {expected} scrape targets not up within "
                    f"{timeout_s:.0f}s: {down}"
                )
            time.sleep(0.5)

    def wait_scraped_after(self, moment: float, timeout_s: float) -> None:
        """Every target has been scraped again after ``moment`` (unix time): its last values are stored."""
        deadline = time.monotonic() + timeout_s
        while True:
            active = self._get("/api/v1/targets", state="active")["activeTargets"]
            stale = [t["scrapeUrl"] for t in active if _parse_time(t["lastScrape"]) <= moment]
            if not stale:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"targets not scraped again within {timeout_s:.0f}s: {stale}")
            time.sleep(0.5)

    def finite_points(self, query: str, start: float, end: float, step_s: float) -> int:
        """How many finite values ``query`` returns over [start, end] (all series together)."""
        data = self._get("/api/v1/query_range", query=query, start=start, end=end, step=f"{step_s:g}s")
        return sum(
            1 for series in data["result"] for _, value in series["values"] if math.isfinite(float(value))
        )

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule with its health (``ok``, ``err``, ``unknown``) and last error."""
        return [rule for group in self._get("/api/v1/rules")["groups"] for rule in group["rules"]]

    def alerts(self) -> list[dict[str, Any]]:
        """The alerts Prometheus holds now (pending and firing), each with its labels and state."""
        return list(self._get("/api/v1/alerts")["alerts"])

    def wait_alert(self, name: str, labels: dict[str, str], timeout_s: float) -> dict[str, Any]:
        """The alert ``name`` whose labels include ``labels``, once it is firing."""
        deadline = time.monotonic() + timeout_s
        while True:
            alerts = self.alerts()
            for alert in alerts:
                ours = alert["labels"].get("alertname") == name
                if ours and labels.items() <= alert["labels"].items() and alert["state"] == "firing":
                    return alert
            if time.monotonic() > deadline:
                held = [(a["labels"], a["state"]) for a in alerts]
                raise AssertionError(
                    f"alert {name} {labels} not firing within {timeout_s:.0f}s; held: {held}"
                )
            time.sleep(0.5)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _parse_time(text: str) -> float:
    """Prometheus' RFC 3339 timestamps (nanoseconds, ``Z``) as unix seconds; the zero time is 0."""
    if text.startswith("0001-"):
        return 0.0
    from datetime import datetime

    head, _, rest = text.partition(".")
    fraction = "".join(ch for ch in rest if ch.isdigit())[:6] or "0"
    stamp = datetime.fromisoformat(head.replace("Z", "") + "+00:00")
    return stamp.timestamp() + int(fraction.ljust(6, "0")) / 1e6


@contextmanager
def running_prometheus(
    workdir: Path, targets: list[ScrapeTarget], interval_s: float = 1.0, rule_files: list[str] | None = None
) -> Iterator[Prometheus]:
    """Start ``prometheus`` scraping ``targets`` every ``interval_s`` (and evaluating ``rule_files``);
    stop it (and wait) on exit."""
    binary = prometheus_binary()
    if binary is None:
        raise FileNotFoundError("prometheus binary not on PATH (Debian: apt-get install prometheus)")
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(prometheus_config(targets, interval_s=interval_s, rule_files=rule_files))
    )
    log = workdir / "prometheus.log"
    server = None
    for _attempt in range(3):  # another program may take the port between the check and the bind
        port = service_port()
        with log.open("wb") as log_file:
            process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--storage.tsdb.retention.time=1h",
                    "--log.level=warn",
                ],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "GOMAXPROCS": "1"},  # a shared, 2-core machine
            )
        server = Prometheus(f"http://127.0.0.1:{port}", process, log)
        try:
            server.wait_ready(timeout_s=60)
            break
        except AssertionError:
            _stop(process)
            if "address already in use" not in server.log_tail():
                raise
    else:
        raise AssertionError(f"prometheus found no free port in 3 attempts:\n{server and server.log_tail()}")
    try:
        yield server
    finally:
        _stop(server.process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
