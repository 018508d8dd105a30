"""100,000 refused handshakes on a switch's WAN port: how many audit records do they leave?

A stranger that can reach the WAN port (it is open by design) can make the switch refuse a TLS handshake
as often as it likes. Each refusal is counted (``nebula_switch_refusals_total``) and audited, but
aggregated (``nebula_common/audit/aggregate.py``): the first of each source, layer and reason at once,
the repeats of an interval (``NEBULA_SWITCH_REFUSAL_AUDIT_INTERVAL_S``, 60 s) as one record with their
count. This runs ``--handshakes`` TLS handshakes without a client certificate from four threads against
switch b of a ``nebula local up`` deployment with its defaults, waits until the switch has counted them
all and its audit records account for every one, and reports records, audit bytes, handshakes per second
and whether the genuine link stayed up.

Usage: ``python bench/security/refusal_flood.py [--handshakes N] [--out DIR]`` (100,000: about 3-5
minutes on 2 cores); writes ``refusal-flood.json`` and ``.md``. It exits non-zero if the records do not
account for every refusal or exceed two per interval and reason (the first at once, then the count), or
the link went down.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nebula_common.launcher import LocalDeployment
from nebula_common.metrics import read_metrics
from tests.support.tls_probe import handshakes_without_certificate

THREADS = 4


def metric(deployment: LocalDeployment, name: str, **labels: str) -> float:
    """The sum of switch b's samples of ``name`` with ``labels``."""
    text = read_metrics(deployment.endpoints("b").metrics["switch-b"])
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def refusals(deployment: LocalDeployment) -> float:
    return metric(deployment, "nebula_switch_refusals_total", port="wan")


def audit_records(run_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """Switch b's ``link.refused`` records and the bytes of its audit log, every segment."""
    records, size = [], 0
    for path in sorted((run_dir / "b" / "switch").glob("audit.log*")):
        text = path.read_text(errors="replace")
        size += len(text.encode())
        for line in text.splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if record.get("event") == "link.refused":
                    records.append(record)
    return records, size


def wait(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--handshakes", type=int, default=100_000)
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="nebula-refusals-") as tmp,
        LocalDeployment(run_dir=Path(tmp) / "run") as deployment,
    ):
        info = deployment.cluster_state["b"].switch.info  # type: ignore[union-attr]
        address = ("127.0.0.1", info["wan_port"])
        sessions_before = metric(deployment, "nebula_switch_link_up")
        counted_before = refusals(deployment)
        records_before, bytes_before = audit_records(deployment.run_dir)
        started = time.monotonic()
        per_thread = args.handshakes // THREADS
        threads = [
            threading.Thread(target=handshakes_without_certificate, args=(address, per_thread))
            for _ in range(THREADS)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - started
        total = per_thread * THREADS
        wait(lambda: refusals(deployment) - counted_before >= total, 300, f"{total} refusals counted")

        def accounted() -> bool:
            records, _ = audit_records(deployment.run_dir)
            return sum(r["details"].get("count", 1) for r in records[len(records_before) :]) >= total

        wait(accounted, 180, "audit records counting every refusal (one interval: 60 s)")
        records, size = audit_records(deployment.run_dir)
        new = records[len(records_before) :]
        link_up = sessions_before == 1 and metric(deployment, "nebula_switch_link_up") == 1
        minutes = max(1.0, (time.monotonic() - started) / 60)
    reasons = sorted({(r["details"].get("layer"), r["details"].get("reason")) for r in new})
    result = {
        "handshakes": total,
        "seconds": round(elapsed, 1),
        "handshakes_per_s": round(total / elapsed),
        "audit_records": len(new),
        "counted_in_records": sum(r["details"].get("count", 1) for r in new),
        "audit_bytes_added": size - bytes_before,
        "distinct_layer_reasons": [list(r) for r in reasons],
        "link_up": link_up,
    }
    # Per interval and key: its first refusal at once, its repeats as one record when the interval ends.
    bound = 2 * len(reasons) * (math.ceil(minutes) + 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "refusal-flood.json").write_text(json.dumps(result, indent=2))
    (args.out / "refusal-flood.md").write_text(
        f"# {total:,} refused handshakes on the WAN port\n\n"
        f"{result['handshakes_per_s']:,} handshakes/s for {result['seconds']} s; "
        f"**{len(new)} audit records** ({result['audit_bytes_added']:,} bytes) counting "
        f"{result['counted_in_records']:,} refusals, {len(reasons)} distinct layer/reason; "
        f"link up: {link_up}.\n"
    )
    print(json.dumps(result, indent=2))
    if result["counted_in_records"] < total or len(new) > bound or not link_up:
        raise SystemExit(
            f"failed: {len(new)} records (bound {bound}) counting {result['counted_in_records']}"
        )


if __name__ == "__main__":
    main()
