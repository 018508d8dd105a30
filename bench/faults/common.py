"""Shared pieces of the fault benchmarks: following jobs, sampling processes, a PNG canvas, reports.

Nothing here is part of ``make test``; the scripts in this directory import it as a sibling module.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from nebula_common.launcher import LocalDeployment
from nebula_common.proto.nebula.v1 import trainer_pb2
from nebula_common.sdk.client import ClusterSession

STATE_NAMES = {v: k.removeprefix("STAGE_STATE_").lower() for k, v in trainer_pb2.StageState.items()}
TERMINAL = {
    trainer_pb2.STAGE_STATE_SUCCEEDED,
    trainer_pb2.STAGE_STATE_FAILED,
    trainer_pb2.STAGE_STATE_CANCELLED,
}


def load_info() -> dict[str, Any]:
    """The machine's load when a result was taken (the machine is shared: numbers depend on it)."""
    one, five, fifteen = os.getloadavg()
    return {"loadavg_1m": round(one, 2), "loadavg_5m": round(five, 2), "loadavg_15m": round(fifteen, 2)}


def proc_sample(pid: int) -> dict[str, int] | None:
    """RSS (KiB), thread count and open file descriptors of a live process (None if it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if "VmRSS" not in fields:  # a zombie (killed, not yet reaped)
        return None
    return {
        "rss_kib": int(fields["VmRSS"].split()[0]),
        "threads": int(fields["Threads"].strip()),
        "fds": fds,
        "cpu_s": cpu_seconds(pid),
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (0.0 if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()
    return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)


def process_tree(pid: int) -> Iterator[int]:
    """``pid`` and every live process below it, breadth first (a boxed service is a tree)."""
    pending, seen = [pid], set()
    while pending:
        current = pending.pop(0)
        if current in seen:
            continue
        seen.add(current)
        try:
            tasks = list(Path(f"/proc/{current}/task").iterdir())
        except OSError:
            continue
        yield current
        for task in tasks:
            try:
                pending += [int(child) for child in (task / "children").read_text().split()]
            except OSError:
                continue


def service_pid(pid: int, module: str) -> int:
    """The process running ``python -m <module>`` at or below ``pid``, else ``pid`` itself.

    A boxed service is a tree: bubblewrap, then (the trainer) its box's PID 1, then the service; the
    launcher knows the top. What grows or leaks is the service, so that is the process sampled.
    """
    for current in process_tree(pid):
        try:
            argv = Path(f"/proc/{current}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[1:3] == [b"-m", module.encode()]:
            return current
    return pid


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` and every live process below it."""
    return sum(cpu_seconds(current) for current in process_tree(pid))


class ProcessSampler:
    """Samples named processes of a deployment every ``interval`` s (the current pid: follows restarts),
    and ``gauges`` (name -> a reading, None when it cannot be read: a service's metric) as rows of
    ``{"t", "name", "value"}``."""

    def __init__(
        self,
        deployment: LocalDeployment,
        names: list[str],
        interval: float = 1.0,
        gauges: dict[str, Callable[[], float | None]] | None = None,
    ) -> None:
        self.deployment, self.names, self.interval = deployment, names, interval
        self.gauges = gauges or {}
        self.t0 = time.monotonic()
        self.rows: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> ProcessSampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            now = round(time.monotonic() - self.t0, 2)
            for name in self.names:
                pid = self.deployment.process(name).pid
                try:
                    if pid:
                        pid = service_pid(pid, "services." + name.rsplit("-", 1)[0])
                    sample = proc_sample(pid) if pid else None
                except (OSError, ValueError, KeyError):  # the process went away while being read
                    sample = None
                if sample is not None:
                    self.rows.append({"t": now, "name": name, "pid": pid, **sample})
            for name, read in self.gauges.items():
                self.rows.append({"t": now, "name": name, "value": read()})
            self._stop.wait(self.interval)

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join(5)
        return self.rows

    def series(self, name: str, key: str) -> list[tuple[float, int]]:
        return [(r["t"], r[key]) for r in self.rows if r["name"] == name]


@dataclass
class StageEvent:
    t: float
    stage: str
    state: str
    steps_done: int
    loss: float | None
    message: str


@dataclass
class JobFollower:
    """Follows every stage of a job on its own thread, surviving a trainer restart (it re-watches).

    ``steps`` maps stage -> {step: monotonic time it was first reported done}; ``final`` stage -> last status.
    """

    job_id: str
    stages: dict[str, ClusterSession]
    t0: float = field(default_factory=time.monotonic)
    give_up_s: float = 600.0
    events: list[StageEvent] = field(default_factory=list)
    steps: dict[str, dict[int, float]] = field(default_factory=dict)
    losses: dict[int, float] = field(default_factory=dict)
    #: stage -> {step: the step's wall time as the trainer measured it (StageStatus.step_seconds)}
    reported: dict[str, dict[int, float]] = field(default_factory=dict)
    final: dict[str, trainer_pb2.StageStatus] = field(default_factory=dict)
    final_at: dict[str, float] = field(default_factory=dict)
    watch_errors: list[tuple[float, str, str]] = field(default_factory=list)
    on_status: Callable[[str, trainer_pb2.StageStatus], None] | None = None

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._follow, args=(stage, session), daemon=True)
            for stage, session in self.stages.items()
        ]
        for stage in self.stages:
            self.steps[stage] = {}
            self.reported[stage] = {}
        for thread in self._threads:
            thread.start()

    def _follow(self, stage: str, session: ClusterSession) -> None:
        deadline = time.monotonic() + self.give_up_s
        while time.monotonic() < deadline:
            try:
                for status in session.watch(self.job_id):
                    self._record(stage, status)
                    if status.state in TERMINAL:
                        return
                return
            except Exception as exc:  # trainer killed or restarting: note it, watch again
                code = exc.code().name if isinstance(exc, grpc.RpcError) else type(exc).__name__
                detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
                with self._lock:
                    self.watch_errors.append((round(time.monotonic() - self.t0, 2), code, detail or ""))
                if code in ("NOT_FOUND", "NotFoundError") or "no job" in (detail or ""):
                    # the restarted trainer does not know the job: record it as the stage's end
                    with self._lock:
                        self.final_at.setdefault(stage, time.monotonic())
                        self.final.setdefault(
                            stage,
                            trainer_pb2.StageStatus(
                                job_id=self.job_id,
                                stage=stage,
                                state=trainer_pb2.STAGE_STATE_FAILED,
                                message=f"(watch) {code}: {detail}",
                            ),
                        )
                    return
                time.sleep(0.5)

    def _record(self, stage: str, status: trainer_pb2.StageStatus) -> None:
        now = time.monotonic()
        with self._lock:
            loss = status.loss if status.HasField("loss") else None
            self.events.append(
                StageEvent(
                    round(now - self.t0, 3),
                    stage,
                    STATE_NAMES.get(status.state, str(status.state)),
                    status.steps_done,
                    loss,
                    status.message,
                )
            )
            if status.steps_done and status.state == trainer_pb2.STAGE_STATE_RUNNING and status.step_seconds:
                self.reported[stage].setdefault(status.steps_done, status.step_seconds)
            if status.steps_done and status.steps_done not in self.steps[stage]:
                self.steps[stage][status.steps_done] = now
                if loss is not None:
                    self.losses[status.steps_done] = loss
            if status.state in TERMINAL:
                self.final[stage] = status
                self.final_at[stage] = now
        if self.on_status is not None:
            self.on_status(stage, status)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return all(not t.is_alive() for t in self._threads)

    def done_steps(self, stage: str) -> int:
        with self._lock:
            return max(self.steps[stage], default=0)

    def first_step_after(self, stage: str, at: float) -> tuple[int, float] | None:
        with self._lock:
            later = [(t, s) for s, t in self.steps[stage].items() if t >= at]
        if not later:
            return None
        t, s = min(later)
        return s, t

    def outcome(self) -> dict[str, dict[str, Any]]:
        return {
            stage: {
                "state": STATE_NAMES.get(status.state, str(status.state)),
                "steps_done": status.steps_done,
                "message": status.message,
                "ended_at_s": round(self.final_at[stage] - self.t0, 2),
            }
            for stage, status in self.final.items()
        }

    def step_times(self, stage: str) -> list[float]:
        with self._lock:
            return [t for _, t in sorted(self.steps[stage].items())]

    def mean_reported_step_seconds(self, stage: str, skip: int = 2) -> float | None:
        """Mean of the step wall times the trainer reported (immune to late, batched status delivery)."""
        with self._lock:
            values = [v for s, v in self.reported[stage].items() if s > skip]
        return sum(values) / len(values) if values else None

    def mean_step_seconds(self, stage: str, skip: int = 2) -> float | None:
        """Mean wall time between consecutive reported steps, the first ``skip`` (start-up) left out."""
        with self._lock:
            points = sorted(self.steps[stage].items())
        points = [(s, t) for s, t in points if s > skip]
        if len(points) < 2:
            return None
        (s0, t0), (s1, t1) = points[0], points[-1]
        return (t1 - t0) / (s1 - s0)


def wait_until(condition: Callable[[], Any], timeout: float, what: str, poll: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = condition()
        except Exception:
            value = None
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting until {what}")


def jain(values: list[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n * sum x^2); 1.0 = perfectly equal."""
    if not values:
        return float("nan")
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# A PNG without matplotlib (not a dependency of the project): a small RGB canvas written with zlib.
# No text: every figure's legend (colours, axes) is in the markdown report next to it.

Colour = tuple[int, int, int]
PALETTE: dict[str, Colour] = {
    "white": (255, 255, 255),
    "black": (0, 0, 0),
    "grey": (200, 200, 200),
    "blue": (31, 119, 180),
    "orange": (255, 127, 14),
    "green": (44, 160, 44),
    "red": (214, 39, 40),
    "purple": (148, 103, 189),
    "cut": (255, 220, 220),
    "kill": (220, 220, 255),
    "gap": (255, 240, 200),
}


class Canvas:
    def __init__(self, width: int, height: int, background: Colour = PALETTE["white"]) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def dot(self, x: int, y: int, colour: Colour, r: int = 1) -> None:
        for dy in range(-r, r + 1):
            for dx in range(-r, r + 1):
                self.set(x + dx, y + dy, colour)

    def set(self, x: int, y: int, colour: Colour) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i : i + 3] = bytes(colour)

    def rect(self, x0: int, y0: int, x1: int, y1: int, colour: Colour) -> None:
        for y in range(max(0, min(y0, y1)), min(self.height, max(y0, y1) + 1)):
            for x in range(max(0, min(x0, x1)), min(self.width, max(x0, x1) + 1)):
                i = 3 * (y * self.width + x)
                self.pixels[i : i + 3] = bytes(colour)

    def line(self, x0: int, y0: int, x1: int, y1: int, colour: Colour) -> None:
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for k in range(steps + 1):
            self.set(round(x0 + (x1 - x0) * k / steps), round(y0 + (y1 - y0) * k / steps), colour)

    def save(self, path: Path) -> None:
        raw = b"".join(
            b"\x00" + bytes(self.pixels[3 * y * self.width : 3 * (y + 1) * self.width])
            for y in range(self.height)
        )

        def chunk(kind: bytes, data: bytes) -> bytes:
            return (
                struct.pack(">I", len(data))
                + kind
                + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
            )

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b"")
        )


class Plot:
    """One panel of a canvas: data coordinates mapped into a pixel box, with an axis frame."""

    def __init__(
        self, canvas: Canvas, box: tuple[int, int, int, int], xr: tuple[float, float], yr: tuple[float, float]
    ) -> None:
        self.c, self.box, self.xr, self.yr = canvas, box, xr, (yr[0], yr[1] if yr[1] > yr[0] else yr[0] + 1)
        x0, y0, x1, y1 = box
        canvas.line(x0, y1, x1, y1, PALETTE["black"])
        canvas.line(x0, y0, x0, y1, PALETTE["black"])

    def px(self, x: float, y: float) -> tuple[int, int]:
        x0, y0, x1, y1 = self.box
        fx = (x - self.xr[0]) / (self.xr[1] - self.xr[0] or 1)
        fy = (y - self.yr[0]) / (self.yr[1] - self.yr[0])
        return round(x0 + fx * (x1 - x0)), round(y1 - fy * (y1 - y0))

    def span(self, xa: float, xb: float, colour: Colour) -> None:
        (pa, _), (pb, _) = self.px(xa, 0), self.px(xb, 0)
        self.c.rect(
            max(pa, self.box[0] + 1), self.box[1], min(max(pb, pa + 1), self.box[2]), self.box[3] - 1, colour
        )

    def vline(self, x: float, colour: Colour) -> None:
        p, _ = self.px(x, 0)
        self.c.line(p, self.box[1], p, self.box[3] - 1, colour)

    def points(self, xy: list[tuple[float, float]], colour: Colour, r: int = 1, join: bool = False) -> None:
        last = None
        for x, y in xy:
            p = self.px(x, y)
            if join and last is not None:
                self.c.line(*last, *p, colour)
            self.c.dot(*p, colour, r)
            last = p

    def xticks(self, every: float) -> None:
        v = self.xr[0]
        while v <= self.xr[1]:
            p, _ = self.px(v, 0)
            self.c.line(p, self.box[3], p, self.box[3] + 4, PALETTE["black"])
            v += every
