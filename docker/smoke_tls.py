"""Internal TLS of the compose deployment, checked from inside each cluster's network.

    bash docker/run-smoke.sh          # runs this after docker/smoke.py, on the same deployment
    export NEBULA_ADMIN_PASSWORD_A=... NEBULA_CA_CERT_A=a-ca.crt    # as docker/smoke.py's docstring
    export NEBULA_ADMIN_PASSWORD_B=... NEBULA_CA_CERT_B=b-ca.crt
    .venv/bin/python docker/smoke_tls.py --compose podman-compose

The service ports are not published, so a probe runs inside the ``codec-<c>`` container (on the
cluster network, holding the codec's own certificate) and, for each of the cluster's 10 internal
ports (auth, codec, data, trainer, switch: client port and service port), checks that

1. a plaintext gRPC call fails;
2. a TLS call without a client certificate fails on every service port (and, as a control, that the
   same TLS call succeeds on the client port, so the failure is the missing certificate);
3. a call with the codec's certificate to a method only the trainer may call (the switch's
   ``Relay/OpenEdge`` on its service port) is refused with PERMISSION_DENIED (and, as a control, a
   health check with the same certificate on the same port succeeds).

Then, from the host, the cluster admin reads the switch's audit log (``AuditLog/Query`` on the
published switch port, TLS verified against the cluster's CA) and finds the refusal
(``auth.refused`` naming ``spiffe://nebula/cluster/<c>/codec`` and the method).

Prints a JSON report; exits 1 naming every check that failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# Runs inside codec-<c> with the image's Python: grpc and the generated protos only.
PROBE = r"""
import json, sys
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from nebula_common.proto.nebula.v1 import relay_pb2

cluster = sys.argv[1]
# service -> [client port address, service port address]; the compose names unless given (tests)
ADDRESSES = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {
    s: [f"{s}-{cluster}:{port}", f"{s}-{cluster}:{port + 1}"]
    for s, port in {"auth": 7600, "codec": 7700, "data": 7800, "trainer": 7500, "switch": 7400}.items()
}
tls = sys.argv[3] if len(sys.argv) > 3 else "/etc/nebula/internal-tls/"
ca, cert, key = (open(tls + name, "rb").read() for name in ("ca.crt", "service.crt", "service.key"))

def override(service):
    return [("grpc.ssl_target_name_override", f"{service}.{cluster}.nebula.internal")]

def health(channel):
    try:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        return "SERVING" if status == 1 else f"status {status}"
    except grpc.RpcError as exc:
        return exc.code().name

out = {"plaintext": {}, "tls_without_cert_service_port": {}, "tls_without_cert_client_port": {}}
anonymous = grpc.ssl_channel_credentials(root_certificates=ca)
for service, (client_port, service_port) in ADDRESSES.items():
    for address in (client_port, service_port):
        with grpc.insecure_channel(address) as channel:
            out["plaintext"][address] = health(channel)
    with grpc.secure_channel(service_port, anonymous, override(service)) as channel:
        out["tls_without_cert_service_port"][service_port] = health(channel)
    with grpc.secure_channel(client_port, anonymous, override(service)) as channel:
        out["tls_without_cert_client_port"][client_port] = health(channel)

codec = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
with grpc.secure_channel(ADDRESSES["switch"][1], codec, override("switch")) as channel:
    out["codec_cert_health_on_switch_service_port"] = health(channel)
    open_edge = channel.stream_stream(
        "/nebula.v1.Relay/OpenEdge",
        request_serializer=relay_pb2.EdgeMessage.SerializeToString,
        response_deserializer=relay_pb2.EdgeMessage.FromString,
    )
    opening = relay_pb2.EdgeMessage(open=relay_pb2.EdgeOpen(job_id="smoke-tls-not-a-codec-job", edge="e"))
    try:
        next(iter(open_edge(iter([opening]), timeout=10)))
        out["codec_cert_open_edge"] = {"code": "OK", "details": ""}
    except grpc.RpcError as exc:
        out["codec_cert_open_edge"] = {"code": exc.code().name, "details": exc.details() or ""}
print(json.dumps(out))
"""

HOST = "127.0.0.1"
PUBLISHED = {"a": {"switch": 17400, "auth": 17600}, "b": {"switch": 27400, "auth": 27600}}
METHOD = "/nebula.v1.Relay/OpenEdge"


def probe(compose: str, cluster: str) -> dict[str, Any]:
    """Run PROBE inside ``codec-<cluster>``; its JSON result."""
    command = [*shlex.split(compose), "exec", "-T", f"codec-{cluster}", "python", "-c", PROBE, cluster]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    if result.returncode != 0:
        raise SystemExit(
            f"smoke_tls: the probe in codec-{cluster} failed ({result.returncode}): {result.stderr}"
        )
    return json.loads(result.stdout.strip().splitlines()[-1])


def audited_refusals(cluster: str, ca: Path, admin_password: str, since: float) -> list[dict[str, Any]]:
    """The switch's ``auth.refused`` records since ``since``, read by the cluster admin from the host."""
    from nebula_common.proto.nebula.v1 import audit_pb2, audit_pb2_grpc
    from nebula_common.rpc import bearer_metadata
    from nebula_common.rpc.internal_tls import ClientTls, internal_channel, trust_endpoint
    from nebula_common.sdk.auth_client import AuthClient

    switch, auth = (f"{HOST}:{PUBLISHED[cluster][s]}" for s in ("switch", "auth"))
    for address in (switch, auth):
        trust_endpoint(address, ClientTls(cluster, ca))
    with AuthClient(auth) as client:
        token = client.login("admin", admin_password).token
    with internal_channel(switch, service="switch") as channel:
        reply = audit_pb2_grpc.AuditLogStub(channel).Query(
            audit_pb2.AuditQuery(event="auth.refused", since_unix=since),
            metadata=bearer_metadata(token),
            timeout=15,
        )
    return [json.loads(record) for record in reply.records_json]


def failures(cluster: str, found: dict[str, Any], refusals: list[dict[str, Any]]) -> list[str]:
    """What the probe and the audit log show that must not happen on an internal port."""
    bad = [
        f"plaintext call to {addr} answered: {r}" for addr, r in found["plaintext"].items() if r == "SERVING"
    ]
    if len(found["plaintext"]) != 10:
        bad.append(f"cluster {cluster}: probed {len(found['plaintext'])} ports, expected 10")
    for addr, r in found["tls_without_cert_service_port"].items():
        if r == "SERVING":
            bad.append(f"TLS call without a client certificate to service port {addr} answered")
    for addr, r in found["tls_without_cert_client_port"].items():
        if r != "SERVING":
            bad.append(f"control: TLS (no client certificate) to client port {addr} should answer, got {r}")
    if found["codec_cert_health_on_switch_service_port"] != "SERVING":
        bad.append(f"control: codec certificate health check on switch-{cluster}:7401 failed")
    refused = found["codec_cert_open_edge"]
    if refused["code"] != "PERMISSION_DENIED" or f"may not call {METHOD}" not in refused["details"]:
        bad.append(
            f"codec certificate calling {METHOD} on switch-{cluster}: {refused}, not PERMISSION_DENIED"
        )
    codec = f"spiffe://nebula/cluster/{cluster}/codec"
    if not any(
        r.get("details", {}).get("peer_identity") == codec and r["details"].get("method") == METHOD
        for r in refusals
    ):
        bad.append(f"switch-{cluster}'s audit log has no auth.refused record of {codec} calling {METHOD}")
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description="Check internal TLS of the running compose deployment.")
    parser.add_argument("--compose", default=os.environ.get("COMPOSE", "podman-compose"))
    parser.add_argument("--clusters", default="a,b")
    args = parser.parse_args()
    report: dict[str, Any] = {}
    bad: list[str] = []
    for cluster in [c.strip() for c in args.clusters.split(",") if c.strip()]:
        password = os.environ.get(f"NEBULA_ADMIN_PASSWORD_{cluster.upper()}", "").strip()
        ca = os.environ.get(f"NEBULA_CA_CERT_{cluster.upper()}", "")
        if not password or not ca or not Path(ca).is_file():
            raise SystemExit(
                f"smoke_tls: set NEBULA_ADMIN_PASSWORD_{cluster.upper()} and "
                f"NEBULA_CA_CERT_{cluster.upper()} (docker/run-smoke.sh does)"
            )
        since = time.time() - 5  # the containers share the host's clock
        found = probe(args.compose, cluster)
        refusals = audited_refusals(cluster, Path(ca), password, since)
        report[cluster] = {**found, "audited_refusals": len(refusals)}
        bad += failures(cluster, found, refusals)
    print(json.dumps(report, indent=2))
    for line in bad:
        print(f"smoke_tls: FAILED: {line}", file=sys.stderr)
    if not bad:
        print("smoke_tls: internal TLS checks passed in every cluster", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
