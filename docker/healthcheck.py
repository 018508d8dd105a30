"""Container health probe: exit 0 when the local gRPC server reports SERVING, else 1.

Used by the image's HEALTHCHECK (compose, podman). Kubernetes uses its native gRPC probe
against the same grpc.health.v1 service instead. Configuration, all optional except the port:

    NEBULA_HEALTH_PORT     port of the service's (plaintext, cluster-internal) gRPC listener
    NEBULA_HEALTH_SERVICE  service name to ask about ("" = the whole server, the default)
    NEBULA_HEALTH_TIMEOUT  seconds before the probe gives up (default 2)

Only 127.0.0.1 is probed: the check runs inside the service's own network namespace.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    port = os.environ.get("NEBULA_HEALTH_PORT", "").strip()
    if not port.isdigit():
        print("healthcheck: NEBULA_HEALTH_PORT is not set to a port number", file=sys.stderr)
        return 1
    service = os.environ.get("NEBULA_HEALTH_SERVICE", "")
    timeout = float(os.environ.get("NEBULA_HEALTH_TIMEOUT", "2"))

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = f"127.0.0.1:{port}"
    try:
        with grpc.insecure_channel(target) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
    except grpc.RpcError as exc:
        print(f"healthcheck: {target} {service!r}: {exc.code().name} {exc.details()}", file=sys.stderr)
        return 1
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        print(f"healthcheck: {target} {service!r}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
