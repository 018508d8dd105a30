"""Host-side smoke test of the compose deployment through the SDK (published 127.0.0.1 ports only).

    export NEBULA_ADMIN_PASSWORD_A="$(podman-compose exec auth-a cat /etc/nebula/admin/admin-password)"
    export NEBULA_ADMIN_PASSWORD_B="$(podman-compose exec auth-b cat /etc/nebula/admin/admin-password)"
    podman-compose exec -T auth-a cat /etc/nebula/internal-tls/ca.crt > a-ca.crt   # each cluster's CA:
    podman-compose exec -T auth-b cat /etc/nebula/internal-tls/ca.crt > b-ca.crt   # the ports are TLS
    .venv/bin/python docker/smoke.py --steps 20 --ca-a a-ca.crt --ca-b b-ca.crt

1. waits until both switches report the WAN link up (GetLinkStatus) and prints the verified peers;
2. each cluster's admin creates a user in its own cluster (tokens never cross clusters);
3. submits the built-in numbers job (the demo's: encoder in a, decoder in b) and follows it to the end;
4. reads both switches' audit logs (``--audit-exec``, default ``$COMPOSE exec -T`` with COMPOSE
   ``podman-compose``, from the repo root): every edge of the job must have opened on the carrier
   ``--edge-transports`` names, by default records on the switch's edge socket in both clusters
   (``edge.open`` with ``transport: records``), the carrier compose gives the stages a trainer runs;
5. prints a JSON summary (losses, step times, WAN bytes, Prometheus cross-check, each switch's edge
   transports) and exits 0 on success.
   The switches count WAN bytes over the link's life, so the script reads them before and after the
   job and reports this job's share (the counters are not reset between runs on one `up`).

The ports are the ones docker-compose.yml publishes; override with --host-ports-a/--host-ports-b.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from pathlib import Path

from compose_support import SmokeFailure, check_edge_transports, exec_prefix  # this script's directory

from nebula_common.jobspec import load_spec
from nebula_common.jobspec.builtin import builtin_spec
from nebula_common.metrics import trust_metrics_endpoint
from nebula_common.pki.service_identity import ServiceTlsFiles
from nebula_common.rpc.internal_tls import ClientTls, trust_endpoint
from nebula_common.sdk.auth_client import AuthClient
from nebula_common.sdk.client import ClusterEndpoints, ClusterSession, submit_job
from nebula_common.sdk.jobs import ProgramJob
from nebula_common.sdk.summary import JobSummary, summarize

HOST = "127.0.0.1"
# switch internal, trainer, auth, switch metrics (see docker-compose.yml)
DEFAULT_PORTS = {"a": "17400,17500,17600,19100", "b": "27400,27500,27600,29100"}


def endpoints(cluster: str, ports: str, ca: Path, monitoring: Path | None = None) -> ClusterEndpoints:
    """The cluster's published ports, each verified against the cluster's own CA (internal TLS).

    ``monitoring``: the cluster's scraper identity (``nebula compose endpoints`` copies it out), which
    the switch's ``/metrics`` asks for; without it the trainers count the job's WAN bytes.
    """
    switch, trainer, auth, metrics = (int(p) for p in ports.split(","))
    for port in (switch, trainer, auth):
        trust_endpoint(f"{HOST}:{port}", ClientTls(cluster, ca))
    scraped = {}
    if monitoring is not None:
        trust_metrics_endpoint(f"{HOST}:{metrics}", ServiceTlsFiles.in_dir(monitoring), cluster, "switch")
        scraped = {f"switch-{cluster}": f"https://{HOST}:{metrics}/metrics"}
    return ClusterEndpoints(
        cluster_id=cluster,
        auth=f"{HOST}:{auth}",
        trainer=f"{HOST}:{trainer}",
        switch=f"{HOST}:{switch}",
        metrics=scraped,
    )


def create_user(ep: ClusterEndpoints, admin_password: str, username: str) -> ClusterSession:
    password = secrets.token_urlsafe(18)
    with AuthClient(ep.auth) as auth:
        admin = auth.login("admin", admin_password)
        auth.create_account(admin.token, username, password, role="user")
    return ClusterSession.login(ep, username, password)


def wait_link(sessions: list[ClusterSession], timeout: float) -> float:
    started = time.perf_counter()
    while True:
        states = [s.link_status() for s in sessions]
        if all(st.connected for st in states):
            for st in states:
                print(
                    f"switch {st.cluster_id}: link up as {st.link_role} over {st.link_carrier}, "
                    f"verified peer {st.verified_peer_identity}",
                    file=sys.stderr,
                )
                if st.link_carrier != "records":  # compose runs the default carrier
                    raise SystemExit(f"switch {st.cluster_id}: link carrier {st.link_carrier!r}, not records")
            return time.perf_counter() - started
        if time.perf_counter() - started > timeout:
            raise SystemExit(f"WAN link not up after {timeout:.0f}s: {states}")
        time.sleep(0.5)


_COUNTS = ("bytes", "payload_bytes", "raw_bytes", "frames", "bytes_received_by_peer", "prometheus_bytes")


def job_wan(before: dict, after: dict) -> dict:
    """This job's WAN bytes: the link's cumulative counters after the job minus those before it."""
    out = {}
    for direction, entry in after.items():
        start = before.get(direction, {})
        delta = dict(entry)
        for key in _COUNTS:
            if isinstance(entry.get(key), int) and isinstance(start.get(key), int):
                delta[key] = entry[key] - start[key]
        # Without the switches' series (no scraper identity given) the trainers count payload only.
        raw, payload, wire = delta.get("raw_bytes", 0), delta.get("payload_bytes", 0), delta.get("bytes", 0)
        delta["compression_ratio"] = raw / payload if payload else 0.0
        delta["wire_ratio"] = raw / wire if wire else 0.0
        out[direction] = delta
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description="Smoke-test the compose deployment from the host.")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--codec-forward", default="none")
    parser.add_argument("--codec-backward", default="none")
    parser.add_argument("--host-ports-a", default=DEFAULT_PORTS["a"], help="switch,trainer,auth,metrics")
    parser.add_argument("--host-ports-b", default=DEFAULT_PORTS["b"], help="switch,trainer,auth,metrics")
    parser.add_argument("--link-timeout", type=float, default=60.0)
    parser.add_argument(
        "--edge-transports",
        default="switch-a=records,switch-b=records",
        help="SWITCH=records|grpc,...: the carrier every edge of the job must have opened on at that switch",
    )
    parser.add_argument(
        "--audit-exec",
        default=f"{os.environ.get('COMPOSE', 'podman-compose')} exec -T",
        help="command prefix that runs a command in a SWITCH of --edge-transports (default: $COMPOSE "
        "exec -T, a compose service; `podman exec` takes container names)",
    )
    for c in "ab":
        parser.add_argument(
            f"--ca-{c}",
            type=Path,
            default=os.environ.get(f"NEBULA_CA_CERT_{c.upper()}"),
            help=f"cluster {c}'s CA certificate (default: $NEBULA_CA_CERT_{c.upper()})",
        )
        parser.add_argument(
            f"--monitoring-{c}",
            type=Path,
            default=os.environ.get(f"NEBULA_MONITORING_TLS_{c.upper()}"),
            help=f"cluster {c}'s scraper identity, a directory (default: $NEBULA_MONITORING_TLS_{c.upper()})",
        )
    args = parser.parse_args()
    cas = {"a": args.ca_a, "b": args.ca_b}
    scrapers = {"a": args.monitoring_a, "b": args.monitoring_b}
    missing = [c for c, ca in cas.items() if ca is None or not ca.is_file()]
    if missing:
        raise SystemExit(f"the CA certificate of cluster(s) {', '.join(missing)} is missing (--ca-a/--ca-b)")

    passwords = {c: os.environ.get(f"NEBULA_ADMIN_PASSWORD_{c.upper()}", "").strip() for c in "ab"}
    if not all(passwords.values()):
        raise SystemExit("set NEBULA_ADMIN_PASSWORD_A and NEBULA_ADMIN_PASSWORD_B (see the docstring)")
    eps = {
        "a": endpoints("a", args.host_ports_a, cas["a"], scrapers["a"]),
        "b": endpoints("b", args.host_ports_b, cas["b"], scrapers["b"]),
    }

    suffix = secrets.token_hex(3)
    source = create_user(eps["a"], passwords["a"], f"smoke-a-{suffix}")
    target = create_user(eps["b"], passwords["b"], f"smoke-b-{suffix}")
    link_wait = wait_link([source, target], args.link_timeout)

    overrides = {
        "steps": args.steps,
        "edges.0.codec.forward": args.codec_forward,
        "edges.0.codec.backward": args.codec_backward,
    }
    job = ProgramJob(load_spec(builtin_spec("numbers"), overrides))
    baseline = JobSummary(job_id="", steps=0)
    baseline.fill_wan(source, target)
    started = time.perf_counter()
    handle = submit_job(job, {"a": source, "b": target})
    summary = summarize(
        job,
        handle,
        on_step=lambda st: print(
            f"step {st.steps_done}/{job.steps} loss {st.loss:.4f} {st.step_seconds * 1000:.0f} ms",
            file=sys.stderr,
        ),
    )
    summary.fill_wan(source, target)
    summary.wan = job_wan(baseline.wan, summary.wan)
    summary.total_seconds = time.perf_counter() - started
    out = summary.to_json()
    out["link_wait_seconds"] = link_wait
    failed = None
    if summary.succeeded:
        try:
            expected = dict(item.split("=", 1) for item in args.edge_transports.split(","))
            out["edge_transports"] = check_edge_transports(exec_prefix(args.audit_exec), expected, job.job_id)
        except SmokeFailure as exc:
            failed = out["failed"] = str(exc)
    print(json.dumps(out, indent=2))
    for session in (source, target):
        session.close()
    if failed:
        print(f"smoke: FAILED: {failed}", file=sys.stderr)
    return 0 if summary.succeeded and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
