"""The compose profile `monitoring` against the live deployment: each cluster's Prometheus scrapes its
five services over mutual TLS, loads every alert rule, and answers every dashboard panel.

Run by docker/run-smoke.sh after a job (``--since``: when its Prometheus came up). Each Prometheus is
on its cluster's network only, so this script asks it from inside its container (``<compose> exec -T
prometheus-<c> python -c ...``, one exec per cluster carrying every query). Checks, per cluster:

* 5 targets (switch, trainer, auth, codec, data), all ``up``, all scraped over ``https``;
* every rule of docker/monitoring/alerts.yml loaded and evaluated without error, and exactly the
  alerts the jobs before should fire (``--expect-firing``: smoke_hostile.py's probe stage ends FAILED
  in cluster a, so ``NebulaJobsFailing:a``) firing, nothing else;
* every query of every panel of docker/monitoring/nebula-dashboard.json returns at least one finite
  value, in at least one cluster, over the time since ``--since`` (the jobs' series included; the loss
  only where the loss-owning stage runs).

Prints one JSON summary; exits 1 naming what was not as expected.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docker" / "monitoring" / "nebula-dashboard.json"
SERVICES = {"switch", "trainer", "auth", "codec", "data"}

# Runs inside the Prometheus container (python:3.11-slim base): every API call the checks need.
PROBE = """
import base64, json, sys, urllib.parse, urllib.request
ask = json.loads(base64.b64decode(sys.argv[1]))
def get(path, **params):
    url = "http://127.0.0.1:9090" + path + "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=20) as response:
        return json.loads(response.read())["data"]
out = {"targets": get("/api/v1/targets", state="active")["activeTargets"],
       "rules": [r for g in get("/api/v1/rules")["groups"] for r in g["rules"]],
       "alerts": get("/api/v1/alerts")["alerts"], "queries": {}}
for expr in ask["queries"]:
    data = get("/api/v1/query_range", query=expr, start=ask["start"], end=ask["end"], step="5s")
    out["queries"][expr] = [v for s in data["result"] for _, v in s["values"]]
print(json.dumps(out))
"""


def probe(compose: list[str], cluster: str, queries: list[str], start: float) -> dict[str, Any]:
    ask = base64.b64encode(json.dumps({"queries": queries, "start": start, "end": time.time()}).encode())
    argv = [*compose, "exec", "-T", f"prometheus-{cluster}", "python", "-c", PROBE, ask.decode()]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise SystemExit(f"prometheus-{cluster}: the probe exited {done.returncode}: {done.stderr[-600:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _has_data(values: list[str]) -> bool:
    return any(math.isfinite(float(v)) for v in values)


def _ready(seen: dict[str, Any]) -> bool:
    healthy = [t for t in seen["targets"] if t["health"] == "up" and t["scrapeUrl"].startswith("https://")]
    return (
        len(healthy) == len(SERVICES)
        and len(seen["rules"]) > 0
        and all(r["health"] == "ok" for r in seen["rules"])
    )


def observe(
    compose: list[str], queries: list[str], since: float, deadline: float
) -> dict[str, dict[str, Any]]:
    """Both Prometheus, once every target is scraped, every rule evaluated and every panel query has data
    in at least one cluster (the loss only where the loss-owning stage runs)."""
    while True:
        seen = {cluster: probe(compose, cluster, queries, since) for cluster in ("a", "b")}
        empty = [q for q in queries if not any(_has_data(seen[c]["queries"][q]) for c in seen)]
        if all(_ready(each) for each in seen.values()) and not empty:
            return seen
        if time.time() > deadline:
            problems = {
                cluster: {
                    "targets": [(t["scrapeUrl"], t["health"], t["lastError"]) for t in each["targets"]],
                    "rules not ok": [
                        (r["name"], r["health"], r.get("lastError"))
                        for r in each["rules"]
                        if r["health"] != "ok"
                    ],
                }
                for cluster, each in seen.items()
            }
            raise SystemExit(f"monitoring not as expected: {problems}; panel queries without data: {empty}")
        time.sleep(5)


def check(seen: dict[str, dict[str, Any]], expect_firing: set[tuple[str, str]]) -> dict[str, Any]:
    """Each cluster scrapes its own five services only; exactly the expected alerts fire."""
    summary: dict[str, Any] = {}
    firing = set()
    for cluster, each in seen.items():
        labels = [t["labels"] for t in each["targets"]]
        if sorted(lab.get("service", "") for lab in labels) != sorted(SERVICES) or any(
            lab.get("cluster") != cluster for lab in labels
        ):
            raise SystemExit(f"prometheus-{cluster}: scrapes {labels}")
        if len(each["rules"]) < 9:
            raise SystemExit(f"prometheus-{cluster}: only {len(each['rules'])} rules loaded")
        firing |= {(a["labels"]["alertname"], cluster) for a in each["alerts"] if a["state"] == "firing"}
        summary[cluster] = {"targets_up_https": len(labels), "rules_ok": len(each["rules"])}
    if firing != expect_firing:
        raise SystemExit(f"alerts firing {sorted(firing)}, expected {sorted(expect_firing)}")
    summary["firing"] = sorted(firing)
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compose", default="podman-compose -p nebula", help="The compose command.")
    parser.add_argument("--since", type=float, required=True, help="Unix time the Prometheus came up.")
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument(
        "--targets-only", action="store_true", help="Only wait until every target is scraped (before a job)."
    )
    parser.add_argument(
        "--expect-firing",
        action="append",
        default=[],
        metavar="ALERT:CLUSTER",
        help="An alert the jobs before should have fired (repeatable); every other firing alert fails.",
    )
    args = parser.parse_args()
    compose = [*shlex.split(args.compose), "--profile", "monitoring"]  # else compose does not know them
    dashboard = json.loads(DASHBOARD.read_text())
    queries = (
        [] if args.targets_only else [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    )
    seen = observe(compose, queries, args.since, time.time() + args.timeout)
    if args.targets_only:
        return 0
    expected = {tuple(item.split(":", 1)) for item in args.expect_firing}
    summary = check(seen, expected)  # type: ignore[arg-type]
    summary["panel_queries_with_data"] = len(queries)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
