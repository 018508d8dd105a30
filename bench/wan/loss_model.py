"""The emulator's loss model against the Mathis formula: does a lossy link cost what it costs Reno?

``tc netem`` (the kernel's loss) does not work on these machines, so the lossy emulator cannot be
compared with the kernel like its shaping is (``bench/wan/link.py``). The reference here is the
steady-state throughput of a Reno sender (Mathis et al., 1997): ``MSS / RTT * sqrt(3 / (2 p))`` per
connection, i.e. N times that for N connections as long as the link has room.

Steady state is measured as a difference, so slow start and the connection set-up cancel out: two
transfers of S1 and S2 bytes over the same emulated link (same seed), throughput
``(S2 - S1) / (t2 - t1)``. Everything runs in this process on loopback (sender, emulator, sink).

    .venv/bin/python bench/wan/loss_model.py --out bench-results/wan-link      # ~1-2 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.wan import link_peer
from nebula_common.wan import LinkShape, WanEmulator

# (one-way delay ms, loss, connections, S1 bytes, S2 bytes) on a 100 Mbit/s link.
CASES: list[tuple[float, float, int, int, int]] = [
    (10.0, 0.01, 1, 1_000_000, 6_000_000),
    (10.0, 0.01, 4, 2_000_000, 12_000_000),
    (80.0, 0.001, 1, 6_000_000, 14_000_000),  # past slow start's overshoot: several halvings
    (80.0, 0.001, 4, 2_000_000, 10_000_000),
]
RATE_MBIT = 100.0


async def _transfer(shape: LinkShape, size: int, connections: int) -> tuple[float, int]:
    sink = await asyncio.start_server(link_peer._sink, "127.0.0.1", 0)
    try:
        async with WanEmulator("127.0.0.1", sink.sockets[0].getsockname()[1], shape) as emulator:
            result = await link_peer.send("127.0.0.1", emulator.port, size, connections)
            return float(result["elapsed_s"]), emulator.losses_upstream
    finally:
        sink.close()
        await sink.wait_closed()


def measure(delay_ms: float, loss: float, connections: int, small: int, large: int) -> dict[str, Any]:
    shape = LinkShape(bandwidth_mbit=RATE_MBIT, delay_ms=delay_ms, loss=loss, seed=1)
    t1, losses1 = asyncio.run(_transfer(shape, small, connections))
    t2, losses2 = asyncio.run(_transfer(shape, large, connections))
    steady = (large - small) * 8 / (t2 - t1) / 1e6
    mathis = min(RATE_MBIT, shape.mss * 8 / (2 * shape.delay_s) * math.sqrt(1.5 / loss) / 1e6 * connections)
    return {
        "bandwidth_mbit": RATE_MBIT,
        "delay_ms": delay_ms,
        "loss": loss,
        "connections": connections,
        "bytes": [small, large],
        "elapsed_s": [t1, t2],
        "losses": [losses1, losses2],
        "steady_mbit": steady,
        "mathis_mbit": mathis,
        "ratio": steady / mathis,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results/wan-link"))
    args = parser.parse_args(argv)
    command = " ".join([Path(sys.executable).name, *sys.argv])
    load_before = [round(x, 2) for x in os.getloadavg()]
    rows = []
    for case in CASES:
        row = measure(*case)
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {"command": command, "load_before": load_before, "rows": rows}
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    lines = [
        "# The emulator's loss model vs the Mathis formula",
        "",
        f"Command: `{command}`  ",
        f"Load average before {result['load_before']}, after {result['load_after']} (2 cores, shared).",
        "",
        "Steady state = (S2 - S1) / (t2 - t1) over two transfers; Mathis = N x MSS / RTT x sqrt(3 / 2p),"
        " capped at the link.",
        "",
        "| Mbit/s | delay ms | loss | conns | S1, S2 MB | losses | steady Mbit/s | Mathis Mbit/s | ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        sizes = "/".join(f"{b / 1e6:g}" for b in row["bytes"])
        losses = "/".join(str(n) for n in row["losses"])
        lines.append(
            f"| {row['bandwidth_mbit']:g} | {row['delay_ms']:g} | {row['loss']:g} | {row['connections']} "
            f"| {sizes} | {losses} | {row['steady_mbit']:.2f} | {row['mathis_mbit']:.2f} "
            f"| {row['ratio']:.2f} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "loss_model.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "loss_model.md").write_text("\n".join([*lines, ""]))
    print(f"wrote {args.out / 'loss_model.json'} and {args.out / 'loss_model.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
