"""Two organisations as two hosts: two network namespaces joined by a veth pair shaped with ``tc tbf``.

Each namespace runs ``nebula cluster up`` on its own run directory and PKI; the organisations
exchanged only CA certificates (``pki export-ca`` / ``trust add --fingerprint``). Cluster a's switch
dials b's WAN port across the veth (10.201.x.2:7443), the only address b exposes to a; the numbers
job trains between them. The test process plays both operators: it reaches each cluster's internal
ports through a management veth into that namespace only (tests/support/netns_forward.py), never
through the WAN veth. Nothing in one organisation's directory can be read by the other's processes:
each ``cluster up`` runs in the mount namespace of its ``ip netns exec`` with the other organisation's
directory covered by an empty read-only tmpfs (checked through ``/proc/<pid>/root`` for every process
of both clusters, while the host still sees the files), and the job trains all the same. Every
process's ``/proc/<pid>/environ`` and ``/proc/<pid>/fd`` are checked too (no path of the other
organisation's directory), and the WAN veth's byte counters show the job's traffic crossed it.

Needs root and iproute2 (``ip netns``, ``tc``); skipped otherwise, and outside ``make test-orgs-netns``
(NEBULA_NETNS_E2E=1) because it takes 2-3 minutes on 2 busy cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from nebula_common.cli.pki import app as pki_app
from nebula_common.clients.endpoints import ClusterEndpoints
from nebula_common.rpc.internal_tls import ClientTls, trust_endpoint
from nebula_common.sdk.client import submit_job
from nebula_common.sdk.deployment import onboard
from nebula_common.sdk.summary import summarize
from tests.support.deployments import pids, references, wait_description
from tests.support.jobs import numbers_job
from tests.support.netns import namespaces, run_ip, veth_between, veth_to_us

ROOT = Path(__file__).resolve().parents[2]
E2E_ENV = "NEBULA_NETNS_E2E"
START_DEADLINE_S = 240.0
WAN_PORT = 7443
pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        not os.environ.get(E2E_ENV), reason=f"2-3 min scenario: `make test-orgs-netns` ({E2E_ENV}=1)"
    ),
    pytest.mark.skipif(
        os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
        reason="needs root and iproute2 (ip netns, tc) to build two network namespaces",
    ),
]


@dataclass
class Host:
    cluster: str
    netns: str
    wan_dev: str
    wan_ip: str
    mgmt_ip: str


@contextlib.contextmanager
def two_hosts(rate: str = "50mbit") -> Iterator[dict[str, Host]]:
    """ns a and ns b joined by a WAN veth (tbf-shaped both ways), each with a management veth to us."""
    tag = f"{os.getpid() % 100000}"
    hosts = {
        "a": Host("a", f"nbl-a-{tag}", f"wa{tag}", "10.201.0.1", "10.202.1.2"),
        "b": Host("b", f"nbl-b-{tag}", f"wb{tag}", "10.201.0.2", "10.202.2.2"),
    }
    a, b = hosts["a"], hosts["b"]
    with namespaces(a.netns, b.netns):
        veth_between(*((host.netns, host.wan_dev, f"{host.wan_ip}/24") for host in (a, b)))
        for index, host in enumerate((a, b), start=1):
            # tbf: the WAN's bandwidth per direction (each end shapes what it sends).
            run_ip(
                "ip", "netns", "exec", host.netns, "tc", "qdisc", "add", "dev", host.wan_dev, "root",
                "tbf", "rate", rate, "burst", "64kb", "latency", "100ms",
            )  # fmt: skip
            inner, outer = f"m{host.cluster}{tag}", f"r{host.cluster}{tag}"
            veth_to_us(host.netns, inner, f"{host.mgmt_ip}/24", outer, f"10.202.{index}.1/24")
        yield hosts


def _pki(*args: object) -> str:
    result = CliRunner().invoke(pki_app, [str(a) for a in args])
    assert result.exit_code == 0, result.output + result.stderr
    return result.stdout


# Run by sh in the mount namespace `ip netns exec` makes for each command (a slave of the host's: a
# mount there never propagates back): the other organisation's directory becomes an empty read-only
# tmpfs, so its files cannot be read by this process tree at all.
HIDE = 'mount -t tmpfs -o ro,size=4k,mode=0500 nebula-hidden "$1" && shift && exec "$@"'


def _in(host: Host, *command: str, hide: Path | None = None, **kwargs: Any) -> subprocess.Popen[str]:
    """``command`` in ``host``'s network namespace; with ``hide``, that directory is invisible to it."""
    if hide is not None:
        command = ("sh", "-c", HIDE, "sh", str(hide), *command)
    return subprocess.Popen(
        ["ip", "netns", "exec", host.netns, *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        **kwargs,
    )


def _tx_bytes(host: Host) -> int:
    stats = json.loads(run_ip("ip", "-n", host.netns, "-j", "-s", "link", "show", host.wan_dev))
    return int(stats[0]["stats64"]["tx"]["bytes"])


def test_two_hosts_trust_by_ca_exchange_only_and_train(tmp_path: Path) -> None:
    runs = {c: tmp_path / f"org-{c}" for c in ("a", "b")}
    mail = tmp_path / "mail"
    mail.mkdir()
    fingerprints = {}
    for cluster in ("a", "b"):
        _pki("init", "--dir", runs[cluster] / "pki", "--cluster", cluster)
        fingerprints[cluster] = _pki(
            "export-ca", "--dir", runs[cluster] / "pki", "--cluster", cluster, "--out", mail
        ).strip()
    for cluster, peer in (("a", "b"), ("b", "a")):
        _pki(
            "trust", "add", "--dir", runs[cluster] / "pki", "--cluster", cluster, "--peer", peer,
            "--ca", mail / f"{peer}-ca.crt", "--fingerprint", fingerprints[peer],
        )  # fmt: skip

    processes: list[subprocess.Popen[str]] = []
    ups: dict[str, subprocess.Popen[str]] = {}
    with two_hosts() as hosts:
        try:
            cli = [sys.executable, "-m", "nebula_common.cli.app", "cluster", "up"]
            ups["b"] = _in(
                hosts["b"], *cli, "--cluster", "b", "--peer", "a", "--run-dir", str(runs["b"]),
                "--wan-listen", f"{hosts['b'].wan_ip}:{WAN_PORT}", hide=runs["a"],
            )  # fmt: skip
            ups["a"] = _in(
                hosts["a"], *cli, "--cluster", "a", "--peer", f"b={hosts['b'].wan_ip}:{WAN_PORT}",
                "--run-dir", str(runs["a"]), "--wan-listen", f"{hosts['a'].wan_ip}:{WAN_PORT}",
                hide=runs["b"],
            )  # fmt: skip
            processes += ups.values()
            descriptions = {c: wait_description(ups[c], runs[c], START_DEADLINE_S) for c in ("b", "a")}

            sessions = {}
            for cluster, description in descriptions.items():
                host, found = hosts[cluster], description["clusters"][cluster]["processes"]
                ports = {
                    "auth": found[f"auth-{cluster}"]["grpc_port"],
                    "trainer": found[f"trainer-{cluster}"]["grpc_port"],
                    "codec": found[f"codec-{cluster}"]["grpc_port"],
                    "switch": found[f"switch-{cluster}"]["internal_port"],
                }
                pairs = [f"{host.mgmt_ip}:{p}=127.0.0.1:{p}" for p in ports.values()]
                forwarder = _in(
                    host, sys.executable, str(ROOT / "tests" / "support" / "netns_forward.py"), *pairs
                )
                processes.append(forwarder)
                assert forwarder.stdout is not None and forwarder.stdout.readline().strip() == "ready"
                # Every port is internal TLS from the organisation's own CA (named in its description):
                # the forwarded management addresses are verified against it like the local ones.
                ca = Path(description["clusters"][cluster]["ca_cert"])
                for port in ports.values():
                    trust_endpoint(f"{host.mgmt_ip}:{port}", ClientTls(cluster, ca))
                endpoints = ClusterEndpoints(
                    cluster_id=cluster,
                    **{name: f"{host.mgmt_ip}:{port}" for name, port in ports.items()},
                )
                admin = (runs[cluster] / cluster / "admin-password").read_text().strip()
                sessions[cluster] = onboard(endpoints, admin, f"researcher-{cluster}")[0]

            sent_before = _tx_bytes(hosts["a"]) + _tx_bytes(hosts["b"])
            job = numbers_job(steps=2, data__batch_size=16)
            summary = summarize(job, submit_job(job, sessions))
            assert summary.succeeded, summary
            crossed = _tx_bytes(hosts["a"]) + _tx_bytes(hosts["b"]) - sent_before
            print(f"the job sent {crossed} bytes across the shaped WAN veth")
            assert crossed > 10_000

            for cluster, other in (("a", "b"), ("b", "a")):
                foreign = str(runs[other])
                assert any(runs[other].iterdir()), f"{other}'s run dir is empty on the host"
                for pid in pids(descriptions[cluster]):
                    # Its view of the other organisation's directory (through its own mount namespace):
                    # empty on its host, or not there at all in a service's own box (service_box.py).
                    view = Path(f"/proc/{pid}/root") / runs[other].relative_to("/")
                    seen = list(view.iterdir()) if view.exists() else []
                    assert seen == [], f"{cluster}'s pid {pid} can see {other}'s run dir"
                    leaked = [ref for ref in references(pid) if foreign in ref]
                    assert not leaked, (
                        f"a process of {cluster} (pid {pid}) references {other}'s run dir: {leaked}"
                    )
        finally:
            for up in processes:
                if up.poll() is None:
                    up.send_signal(signal.SIGINT)
            outputs = []
            for up in processes:
                try:
                    outputs.append(up.communicate(timeout=90)[0])
                except subprocess.TimeoutExpired:
                    up.kill()
                    outputs.append(up.communicate()[0])
    for cluster, up in ups.items():
        assert up.returncode == 0, f"cluster up of {cluster} exited {up.returncode}"
