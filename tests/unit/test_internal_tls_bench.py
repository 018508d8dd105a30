"""Parts of `make bench-internal-tls` (bench/security/internal_tls.py) on real pieces, small and fast.

The benchmark's numbers live in docs/bench/internal-tls.md; here only what must hold on any machine:
CPU time is read from /proc, core lists parse like taskset's, and one micro-benchmark round moves every
byte over the services' real TLS stack (client certificate required) and over plaintext.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from nebula_common.pki.service_identity import issue_service_certificate
from nebula_common.pki.store import init_pki
from nebula_common.rpc.internal_tls import ClientTls, ServerTls

pytestmark = pytest.mark.timeout(120)
SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "security" / "internal_tls.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_internal_tls", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def test_core_lists_parse_like_taskset(bench: ModuleType) -> None:
    assert bench.parse_cpus("0,1") == {0, 1}
    assert bench.parse_cpus("0,2-3") == {0, 2, 3}
    assert bench.parse_cpus("") == set()
    with pytest.raises(SystemExit, match="core list"):
        bench.parse_cpus("zero")


def test_cpu_seconds_come_from_proc_and_count_only_the_process(bench: ModuleType) -> None:
    before = bench.cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # burn CPU in this process
        pass
    assert bench.cpu_seconds(os.getpid()) - before >= 0.2
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.5)
        assert bench.cpu_seconds(sleeper.pid) < 0.5  # a sleeping process accrues (almost) nothing
    finally:
        sleeper.kill()
        sleeper.wait()
    assert bench.cpu_seconds(sleeper.pid) == 0.0  # gone
    assert bench.cpu_seconds(None) == 0.0


def test_one_micro_round_over_the_internal_tls_stack_and_plaintext(bench: ModuleType, tmp_path: Path) -> None:
    init_pki(tmp_path / "pki", ["a", "b"])
    server = ServerTls(issue_service_certificate(tmp_path / "pki", "a", "switch", by="test"))
    client = ClientTls.for_service(
        issue_service_certificate(tmp_path / "pki", "a", "trainer", by="test"), "a"
    )
    tls_server, tls_address = bench._echo_server(server.credentials(require_client_auth=True))
    plain_server, plain_address = bench._echo_server(None)
    try:
        tls = bench._micro_round(tls_address, client, 5, 2)  # asserts all 2 MiB arrived
        plain = bench._micro_round(plain_address, None, 5, 2)
        # The TLS port really is mutual TLS: without a client certificate the round cannot run.
        import grpc

        with pytest.raises(grpc.RpcError):
            bench._micro_round(tls_address, ClientTls("a", client.ca), 1, 1)
    finally:
        tls_server.stop(None)
        plain_server.stop(None)
    for result in (tls, plain):
        assert result["unary_median_us"] > 0 and result["stream_mb_per_s"] > 0
        assert result["unary_new_channel_median_ms"] > 0
    out = tmp_path / "out"
    out.mkdir()
    env = {
        "started_unix": time.time(),
        "cpus_online": 2,
        "cpus": "0,1",
        "load_before": [1],
        "load_after": [1],
    }
    micro = {"rounds": {"tls": [tls], "plaintext": [plain]}, "calls_per_round": 5, "stream_mb_per_round": 2}
    micro["median"] = {"tls": tls, "plaintext": plain}
    (out / "micro.json").write_text(json.dumps({"environment": env, **micro}))
    report = bench.markdown(out)
    assert "## Micro-benchmark" in report and f"{tls['stream_mb_per_s']:.0f} MB/s" in report
