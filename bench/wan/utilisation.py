"""How much of an emulated WAN link the real switch pair fills, for 1, 2, 4 and auto link connections.

A real two-cluster deployment (``LocalDeployment``: auth, codec, data, switch and trainer per cluster as
separate processes, the mTLS link between the switches through the WAN emulator). One edge (a job's
``up->down`` route, opened with each cluster's admin token, as the trainers would) sends float32
tensors flat out from cluster a to cluster b; after a warm-up, the emulator's own counters are read
over a fixed window:

- **link utilisation** = wire bytes the emulator carried a -> b (payload, TLS/HTTP2 framing and the
  66-byte per-segment headers it charges) x 8 / (bandwidth x window): how busy the link was;
- **goodput** = tensor payload bytes the receiving edge got in the window x 8 / (bandwidth x window).

Shapes: 60 Mbit/s / 20 ms, 200 Mbit/s / 20 ms, 100 Mbit/s / 80 ms with 0.1% segment loss (seeded).
The switch's connection count is asked for with ``NEBULA_SWITCH_LINK_CONNECTIONS`` (``1``, ``2``,
``4``, ``auto``); a switch that does not export ``nebula_switch_link_connections`` ignores the setting,
so those rows are recorded as ``unsupported`` (the emulator's count of open connections is recorded
too). Every connection shares one aggregate cap in the emulator, so more connections can only help
by filling the same link better, never by getting more of it.

    .venv/bin/python bench/wan/utilisation.py --out bench-results/wan-link        # ~5-15 min
    .venv/bin/python bench/wan/utilisation.py --out /tmp/wu --quick               # shorter windows
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from bench.wan.plots import PALETTE, grouped_bars
from nebula_common.launcher.local import LocalDeployment
from nebula_common.metrics import read_metrics
from nebula_common.pki.service_identity import ServiceTlsFiles, service_tls_dir
from nebula_common.rpc.internal_tls import ClientTls, trust_endpoint
from nebula_common.sdk.auth_client import AuthClient
from services.trainer.edge import EdgeConnection, EdgeSettings, GrpcEdgeTransport

SHAPES: list[tuple[float, float, float]] = [(60.0, 20.0, 0.0), (200.0, 20.0, 0.0), (100.0, 80.0, 0.001)]
CONNECTIONS = ["1", "2", "4", "auto"]
TENSOR_FLOATS = 256 * 1024  # 1 MiB tensors: several per window even on the lossy path
_METRIC = "nebula_switch_link_connections"
EDGE = "up->down"


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def switch_connections(url: str) -> float | None:
    """The switch's ``nebula_switch_link_connections`` gauge, or None if it does not export one."""
    try:
        text = read_metrics(url)
    except OSError:
        return None
    match = re.search(rf"^{_METRIC}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


class Stream:
    """One edge a -> b sending 1 MiB tensors flat out; counts what the receiving end got, and when."""

    def __init__(self, deployment: LocalDeployment, run_dir: Path, job_id: str) -> None:
        tokens = []
        for cluster in deployment.clusters:
            password = (run_dir / cluster / "admin-password").read_text().strip()
            with AuthClient(deployment.endpoints(cluster).auth) as auth:
                tokens.append(auth.login("admin", password).token)
        ends: dict[int, EdgeConnection] = {}
        errors: list[BaseException] = []

        def open_end(index: int) -> None:
            cluster = deployment.clusters[index]
            try:
                # Only a trainer's certificate may open an edge (internal TLS): the switch's service
                # port, presenting the cluster's trainer identity, as a trainer does.
                address = f"127.0.0.1:{deployment.process(f'switch-{cluster}').info['service_port']}"
                files = ServiceTlsFiles.in_dir(service_tls_dir(deployment.pki_dir, cluster, "trainer"))
                trust_endpoint(address, ClientTls.for_service(files, cluster))
                transport = GrpcEdgeTransport(address, tokens[index], job_id, EDGE)
                ends[index] = EdgeConnection(
                    transport, job_id=job_id, edge=EDGE, upstream=index == 0, settings=EdgeSettings()
                )
            except BaseException as exc:
                errors.append(exc)

        openers = [threading.Thread(target=open_end, args=(i,), daemon=True) for i in (0, 1)]
        for thread in openers:
            thread.start()
        for thread in openers:
            thread.join(120)
        if errors or len(ends) != 2:
            for end in ends.values():
                end.abort("benchmark set-up failed")
            raise RuntimeError(f"could not open the benchmark edge: {errors or 'timed out'}")
        self.up, self.down = ends[0], ends[1]
        self.received: list[tuple[float, int]] = []  # (time, payload bytes) per tensor
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._threads = [
            threading.Thread(target=self._send, name="bench-send", daemon=True),
            threading.Thread(target=self._receive, name="bench-receive", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _send(self) -> None:
        tensor = torch.randn(TENSOR_FLOATS)
        step = 0
        try:
            while not self._stop.is_set():
                self.up.send_tensor(tensor, step=step, micro_batch=0)
                step += 1
        except BaseException as exc:
            if not self._stop.is_set():
                self.error = exc

    def _receive(self) -> None:
        step = 0
        try:
            while not self._stop.is_set():
                tensor = self.down.receive_tensor(step=step, micro_batch=0, timeout=600)
                self.received.append((time.monotonic(), tensor.numel() * tensor.element_size()))
                step += 1
        except BaseException as exc:
            if not self._stop.is_set():
                self.error = exc

    def bytes_between(self, start: float, end: float) -> int:
        return sum(n for t, n in self.received if start <= t < end)

    def stop(self) -> None:
        self._stop.set()
        for end in (self.up, self.down):
            end.abort("benchmark finished")
        for thread in self._threads:
            thread.join(30)


def measure(
    rate: float, delay: float, loss: float, connections: str, warmup_s: float, window_s: float, work: Path
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "bandwidth_mbit": rate,
        "delay_ms": delay,
        "loss": loss,
        "connections_requested": connections,
    }
    run_dir = work / f"run-{rate:g}-{delay:g}-{connections}"
    # The launcher's processes inherit this environment: the emulator reads the loss, the switches
    # the connection count (a switch that does not know the setting ignores it).
    settings = {
        "NEBULA_WAN_LOSS": str(loss),
        "NEBULA_WAN_SEED": os.environ.get("NEBULA_WAN_SEED", "1"),
        "NEBULA_SWITCH_LINK_CONNECTIONS": connections,
    }
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        with ExitStack() as stack:
            deployment = LocalDeployment(
                run_dir=run_dir, bandwidth_mbit=rate, delay_ms=delay, supervise=False
            )
            stack.enter_context(deployment)
            stream = Stream(deployment, run_dir, f"util-{rate:g}-{delay:g}-{connections}")
            stack.callback(stream.stop)
            metrics_url = deployment.endpoints("a").metrics.get("switch-a", "")
            started = time.monotonic()
            trace: list[tuple[float, float | None]] = []  # (s since the stream started, connections)

            def sample_until(deadline: float) -> None:
                """Sleep until ``deadline``, reading the switch's connection count about once a second."""
                while (left := deadline - time.monotonic()) > 0:
                    time.sleep(min(1.0, left))
                    trace.append((round(time.monotonic() - started, 1), switch_connections(metrics_url)))

            sample_until(started + warmup_s)  # slow start and the first windows; nothing is asserted on it
            wan = deployment.wan
            t0, s0 = time.monotonic(), wan.status()
            sample_until(t0 + window_s)
            t1, s1 = time.monotonic(), wan.status()
            if stream.error is not None:
                raise RuntimeError(f"the benchmark edge failed: {stream.error}")
            metric = switch_connections(metrics_url)
            capacity_bits = rate * 1e6 * (t1 - t0)
            wire = int(s1["wire_bytes_upstream"]) - int(s0["wire_bytes_upstream"])
            row.update(
                {
                    "window_s": round(t1 - t0, 3),
                    "link_utilisation": wire * 8 / capacity_bits,
                    "goodput_utilisation": stream.bytes_between(t0, t1) * 8 / capacity_bits,
                    "wire_bytes": wire,
                    "losses": int(s1["losses_upstream"]) - int(s0["losses_upstream"]),
                    "emulator_connections_open": s1["connections_open"],
                    "switch_link_connections_metric": metric,
                    # The connection count over warm-up and window (auto: how the tuner moved).
                    "connections_trace": trace,
                    "status": "measured" if metric is not None or connections == "1" else "unsupported",
                }
            )
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return row


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    groups: dict[tuple[float, float, float], list[float | None]] = {}
    for row in rows:
        key = (row["bandwidth_mbit"], row["delay_ms"], row["loss"])
        measured = row.get("status") == "measured"
        groups.setdefault(key, []).append(row["link_utilisation"] if measured else None)
    grouped_bars(path, list(groups.values()), y_min=0.0, y_max=1.0, guides=[(0.95, PALETTE["red"])])


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Link utilisation through the real switch pair",
        "",
        f"Command: `{result['command']}`  ",
        f"Load average before {result['load_before']}, after {result['load_after']} (2 cores, shared).",
        "",
        "| Mbit/s | delay ms | loss | connections | status | link utilisation | goodput "
        "| emulator conns | losses |",
        "|---:|---:|---:|:--|:--|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        if "link_utilisation" not in row:
            cells = [row["status"], "-", "-", "-", "-"]
        else:
            cells = [
                row["status"],
                f"{row['link_utilisation']:.3f}",
                f"{row['goodput_utilisation']:.3f}",
                str(row["emulator_connections_open"]),
                str(row["losses"]),
            ]
        lines.append(
            f"| {row['bandwidth_mbit']:g} | {row['delay_ms']:g} | {row['loss']:g} "
            f"| {row['connections_requested']} | " + " | ".join(cells) + " |"
        )
    lines += [
        "",
        "![link utilisation](utilisation.png)",
        "",
        "Figure: link utilisation per shape in table order; blue 1 connection, orange 2, green 4, purple"
        " auto; a grey stub = not measured (unsupported); y from 0 to 1, red line 0.95.",
    ]
    return "\n".join([*lines, ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results/wan-link"))
    parser.add_argument("--quick", action="store_true", help="shorter warm-up and window")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument(
        "--shapes",
        default=",".join(f"{r:g}/{d:g}/{p:g}" for r, d, p in SHAPES),
        help="MBIT/DELAY_MS/LOSS, comma-separated",
    )
    parser.add_argument("--connections", default=",".join(CONNECTIONS), help="comma-separated: N or auto")
    args = parser.parse_args(argv)
    warmup, window = (3.0, 4.0) if args.quick else (args.warmup, args.window)
    result: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "load_before": _load(),
    }
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="nebula-wan-util-") as tmp:
        shapes = [tuple(float(x) for x in shape.split("/")) for shape in args.shapes.split(",")]
        for rate, delay, loss in shapes:
            supported = True
            for connections in args.connections.split(","):
                if not supported:
                    # The switch ignored the setting for this shape already: one more deployment
                    # would measure the single connection again.
                    rows.append(
                        {"bandwidth_mbit": rate, "delay_ms": delay, "loss": loss,
                         "connections_requested": connections, "status": "unsupported"}
                    )  # fmt: skip
                    continue
                try:
                    row = measure(rate, delay, loss, connections, warmup, window, Path(tmp))
                except Exception as exc:  # one failed deployment must not lose the other rows
                    reason = (str(exc).splitlines() or [repr(exc)])[0][:200].replace("|", "/")
                    row = {"bandwidth_mbit": rate, "delay_ms": delay, "loss": loss,
                           "connections_requested": connections, "status": f"failed: {reason}",
                           "switch_link_connections_metric": None}  # fmt: skip
                # A failed row tells nothing about support: keep trying the other counts.
                supported = row["switch_link_connections_metric"] is not None or row["status"].startswith(
                    "failed"
                )
                print(json.dumps(row), flush=True)
                rows.append(row)
    result["rows"] = rows
    result["load_after"] = _load()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "utilisation.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "utilisation.md").write_text(markdown(result))
    plot(rows, args.out / "utilisation.png")
    print(f"wrote {args.out / 'utilisation.json'} and {args.out / 'utilisation.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
