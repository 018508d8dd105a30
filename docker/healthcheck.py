"""Container health probe: exit 0 when the local gRPC server reports SERVING, else 1.

Used by the image's HEALTHCHECK (compose, podman). Kubernetes uses its native gRPC probe
against the same grpc.health.v1 service instead. Configuration, all optional except the port:

    NEBULA_HEALTH_PORT     port of the service's cluster-internal client port (TLS)
    NEBULA_HEALTH_SERVICE  service name to ask about ("" = the whole server, the default)
    NEBULA_HEALTH_TIMEOUT  seconds before the probe gives up (default 2)
    NEBULA_HEALTH_TLS_CA   the cluster CA to verify the port with (unset: plaintext, development only)
    NEBULA_HEALTH_SERVER_NAME  the name its certificate must carry, e.g. auth.a.nebula.internal

Only 127.0.0.1 is probed: the check runs inside the service's own network namespace.

``healthcheck.py --listening PORT`` instead checks, without opening a connection, that some socket
in this network namespace listens on TCP PORT (for the WAN emulator, which speaks no gRPC and would
dial the far switch for every probe connection).

``healthcheck.py --unix PATH...`` checks that each Unix socket accepts a connection (the audit signer,
which has no network and no health service: a socket that accepts is a log it serves).
"""

from __future__ import annotations

import os
import sys


def _listening(port: int) -> bool:
    """Whether /proc/net/tcp{,6} shows a LISTEN (state 0A) socket on ``port``."""
    suffix = f":{port:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as handle:
                rows = handle.readlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 3 and fields[1].endswith(suffix) and fields[3] == "0A":
                return True
    return False


def _accepting(path: str) -> bool:
    """Whether the Unix socket at ``path`` accepts a connection (closed at once, nothing sent)."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)
        try:
            probe.connect(path)
        except OSError as exc:
            print(f"healthcheck: {path}: {exc.strerror or exc}", file=sys.stderr)
            return False
    return True


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "--unix":
        return 0 if all([_accepting(path) for path in argv[1:]]) else 1
    if len(argv) == 2 and argv[0] == "--listening" and argv[1].isdigit():
        if _listening(int(argv[1])):
            return 0
        print(f"healthcheck: nothing listens on TCP port {argv[1]}", file=sys.stderr)
        return 1
    if argv:
        print("usage: healthcheck.py [--listening PORT | --unix PATH...]", file=sys.stderr)
        return 2
    port = os.environ.get("NEBULA_HEALTH_PORT", "").strip()
    if not port.isdigit():
        print("healthcheck: NEBULA_HEALTH_PORT is not set to a port number", file=sys.stderr)
        return 1
    service = os.environ.get("NEBULA_HEALTH_SERVICE", "")
    timeout = float(os.environ.get("NEBULA_HEALTH_TIMEOUT", "2"))

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = f"127.0.0.1:{port}"
    ca_path = os.environ.get("NEBULA_HEALTH_TLS_CA", "").strip()
    if ca_path:
        try:
            with open(ca_path, "rb") as handle:
                ca = handle.read()
        except OSError as exc:
            print(f"healthcheck: cannot read NEBULA_HEALTH_TLS_CA {ca_path}: {exc.strerror}", file=sys.stderr)
            return 1
        name = os.environ.get("NEBULA_HEALTH_SERVER_NAME", "").strip()
        options = [("grpc.ssl_target_name_override", name)] if name else []
        channel = grpc.secure_channel(
            target, grpc.ssl_channel_credentials(root_certificates=ca), options=options
        )
    else:
        channel = grpc.insecure_channel(target)
    try:
        with channel:
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
    sys.exit(main(sys.argv[1:]))
