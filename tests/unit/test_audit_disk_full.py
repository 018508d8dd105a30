"""A full audit disk: operations fail, the service says so in its health and metrics, nothing is torn.

A process of its own (so that its file size limit is the only one touched) serves the audit API's
health on a real gRPC server beside a real audit log, then lowers ``RLIMIT_FSIZE`` to just above the
log's size: the kernel refuses further bytes exactly as a full disk does (``EFBIG`` here, ``ENOSPC``
there; a write may be cut short either way). Every append beyond the room fails with ``AuditError``,
the health of ``nebula.v1.AuditLog`` turns NOT_SERVING and ``nebula_audit_writable`` 0; once the limit
is lifted the log takes records again by itself (no operation needed), records how many writes failed
(``audit.resumed``), reports SERVING, and verifies whole: no torn line was left behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from nebula_common.audit import AuditSigner, verify_log

ROOT = Path(__file__).resolve().parents[2]

HARNESS = r"""
import asyncio, json, resource, signal, sys, time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from nebula_common.audit import AuditError, open_service_audit
from nebula_common.audit.servicer import AUDIT_SERVICE_NAME, add_audit_api
from nebula_common.rpc.server import create_server


async def main(directory: str) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
    audit = open_service_audit(Path(directory), service="data", cluster="a")
    server = create_server([AUDIT_SERVICE_NAME])
    port = server.add_insecure_port("grpc", "127.0.0.1:0")
    add_audit_api(server, audit, "data", "a")
    await server.start()

    async def health() -> str:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=AUDIT_SERVICE_NAME), timeout=5)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def until(status: str) -> float:
        started = time.monotonic()
        while (now := await health()) != status:
            if time.monotonic() - started > 20:
                raise SystemExit(f"health stayed {now}, expected {status}")
            await asyncio.sleep(0.05)
        return time.monotonic() - started

    def writable() -> float:
        return REGISTRY.get_sample_value("nebula_audit_writable", {"service": "data"})

    out = {"before": await health(), "writable_before": writable()}
    audit.append("data.upload", details={"n": -1})
    audit.seal()
    room = audit.path.stat().st_size + 700
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (room, hard))
    failed = 0
    for n in range(20):
        try:
            audit.append("data.upload", details={"n": n, "padding": "x" * 120})
        except AuditError:
            failed += 1
    await until("NOT_SERVING")
    out.update(failed=failed, failing=audit.failing[0], writable_full=writable(), full="NOT_SERVING")
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    out["recovered_after_s"] = await until("SERVING")
    out["writable_after"] = writable()
    audit.append("data.upload", details={"n": 99})
    audit.close()
    await server.stop(0)
    print(json.dumps(out))


asyncio.run(main(sys.argv[1]))
"""


def test_a_full_disk_is_said_in_health_and_metrics_and_tears_nothing(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", HARNESS, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert (out["before"], out["writable_before"]) == ("SERVING", 1.0)
    assert 0 < out["failed"] < 20, out  # some fitted, the rest failed
    assert out["failing"] >= out["failed"] and out["writable_full"] == 0.0
    assert out["recovered_after_s"] < 10 and out["writable_after"] == 1.0
    log = tmp_path / "audit.log"
    assert verify_log(log, AuditSigner.load_or_create(tmp_path).verifier()).ok
    records = [json.loads(line) for line in log.read_text().splitlines()]
    resumed = [r for r in records if r["event"] == "audit.resumed"]
    assert len(resumed) == 1 and resumed[0]["details"]["failed_writes"] >= out["failed"]
    written = [r["details"]["n"] for r in records if r["event"] == "data.upload"]
    assert written == sorted(written) and written[-1] == 99 and len(written) == 1 + (20 - out["failed"]) + 1
