"""A stage on two separately started trainer workers, each in its own network namespace (two hosts).

Two network namespaces play two hosts of one cluster. Each is joined to the trainer's side (this
test process, in the host namespace, which hosts the trainer's rank store and is a member of each
stage's command group) by its own veth pair, and the two are joined to each other by a third veth
pair, the cluster's network between them, which carries the ranks' own gloo traffic.
One ``python -m services.trainer.worker`` is started in each namespace, the standard way
(torchrun's variables: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` = rank 0's
address, c10d rendezvous over ``env://``; ``GLOO_SOCKET_IFNAME`` names the namespace's link to the
other host, as an operator does on a multi-homed node). They form one gloo group across the
namespaces and join the trainer's rank store; the stage's runner (which alone holds the edge)
drives them through a real job's steps, and the stage trains exactly like one process with the
combined batch (losses and final parameters within 1e-5), for ``ddp`` and then ``fsdp``.

The test checks that the two workers really live in different network namespaces (their
``/proc/<pid>/ns/net`` differ from each other and from ours) and that their gloo traffic crossed
the link between the namespaces (its byte counters grew by more than the stage's gradients per step).

Needs root and iproute2 (``ip netns``); skipped otherwise, and outside ``make test-ranks-netns``
(NEBULA_NETNS_RANKS_E2E=1). About 1-2 minutes on 2 busy cores.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from nebula_common.pki import PkiLayout
from services.trainer.runtime.rank_sources import ClusterRanks
from tests.support.edges import StageRun, finish, wait_for
from tests.support.netns import namespaces, run_ip, veth_between, veth_to_us
from tests.support.ranks import gated_ranks
from tests.support.stage_log import STAGE_LOGGER, stage_running
from tests.unit.test_runtime_cluster_ranks import run_on_ranks
from tests.unit.test_runtime_sharded_stage import STEPS, reference, same_training, small

ROOT = Path(__file__).resolve().parents[2]
E2E_ENV = "NEBULA_NETNS_RANKS_E2E"
MASTER_PORT = 29500
JOIN_DEADLINE_S = 240.0
__all__ = ["reference"]  # the one-process run with the combined batch (a fixture)
pytestmark = [
    pytest.mark.integration,
    pytest.mark.ranks,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        not os.environ.get(E2E_ENV), reason=f"1-2 min scenario: `make test-ranks-netns` ({E2E_ENV}=1)"
    ),
    pytest.mark.skipif(
        os.geteuid() != 0 or not shutil.which("ip"),
        reason="needs root and iproute2 (ip netns) to put each worker in its own network namespace",
    ),
]


@dataclass
class Host:
    """One namespace: its link to the other host (``peer_dev``/``peer_ip``) and to the trainer."""

    rank: int
    netns: str
    peer_dev: str
    peer_ip: str
    trainer_ip: str  # the trainer's address on this namespace's link to it


@contextlib.contextmanager
def two_hosts() -> Iterator[list[Host]]:
    """Namespaces 0 and 1 joined by a veth pair (10.204.0.0/24), each with a veth to our namespace."""
    tag = f"{os.getpid() % 100000}"
    hosts = [Host(r, f"nbl-r{r}-{tag}", f"kr{r}{tag}", f"10.204.0.{r + 1}", f"10.205.{r}.1") for r in (0, 1)]
    with namespaces(*(host.netns for host in hosts)):
        veth_between(*((host.netns, host.peer_dev, f"{host.peer_ip}/24") for host in hosts))
        for host in hosts:
            inner, outer = f"ti{host.rank}{tag}", f"to{host.rank}{tag}"
            veth_to_us(host.netns, inner, f"10.205.{host.rank}.2/24", outer, f"{host.trainer_ip}/24")
            # The trainer is in the ranks' command group too: it reaches each rank's address on the
            # hosts' network through that rank's own veth, and the ranks reach every address of the
            # trainer's host through theirs (so rank-to-rank traffic alone uses the hosts' link).
            run_ip("ip", "-n", host.netns, "route", "add", "default", "via", host.trainer_ip)
            run_ip("ip", "route", "add", f"{host.peer_ip}/32", "via", f"10.205.{host.rank}.2")
        yield hosts


def _bytes(host: Host) -> int:
    """Bytes sent plus received on ``host``'s link to the other namespace."""
    stats = json.loads(run_ip("ip", "-n", host.netns, "-j", "-s", "link", "show", host.peer_dev))
    counters = stats[0]["stats64"]
    return int(counters["tx"]["bytes"]) + int(counters["rx"]["bytes"])


class NamespacedWorkers:
    """One worker per namespace, each started on its own by ``ip netns exec`` (our children, by handle)."""

    def __init__(
        self, hosts: list[Host], ranks: ClusterRanks, data_dir: Path, logs: Path, env: dict[str, str]
    ) -> None:
        self.hosts, self.logs = hosts, logs
        self.processes: list[subprocess.Popen[bytes]] = []
        for host in hosts:
            worker = {
                **env,  # its identity for the rank store's gate
                "PYTHONPATH": str(ROOT),
                "RANK": str(host.rank),
                "WORLD_SIZE": str(len(hosts)),
                "MASTER_ADDR": hosts[0].peer_ip,  # rank 0's address on the hosts' network
                "MASTER_PORT": str(MASTER_PORT),
                "GLOO_SOCKET_IFNAME": host.peer_dev,
                "NEBULA_WORKER_TRAINER": f"{host.trainer_ip}:{ranks.port}",
                "NEBULA_WORKER_DATA_DIR": str(data_dir),
                "OMP_NUM_THREADS": "1",
            }
            for name in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
                worker.pop(name, None)
            with (logs / f"worker-{host.rank}.log").open("wb") as log:
                self.processes.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", host.netns, sys.executable, "-m", "services.trainer.worker"],
                        env=worker,
                        stdout=log,
                        stderr=log,
                        cwd=ROOT,
                    )
                )

    def text(self) -> str:
        return "\n".join(
            f"--- worker {h.rank}\n{(self.logs / f'worker-{h.rank}.log').read_text(errors='replace')[-2000:]}"
            for h in self.hosts
        )

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)  # `ip netns exec` execs the worker: its pid is ours
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


Cluster = tuple[NamespacedWorkers, ClusterRanks, Path]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, pki_ab: PkiLayout) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("netns-ranks")
    with two_hosts() as hosts:
        # Reached from each namespace over its own veth, through the mutual-TLS gate.
        ranks, env = gated_ranks(pki_ab, world=2, listen="0.0.0.0:0")
        work = tmp / "work"
        workers = NamespacedWorkers(hosts, ranks, work / "head", tmp, env)
        try:
            wait_for(
                lambda: len(ranks.joined()) == 2 or any(p.poll() is not None for p in workers.processes),
                JOIN_DEADLINE_S,
                "the two namespaced workers to join the trainer's rank store",
            )
            assert all(p.poll() is None for p in workers.processes), f"a worker exited:\n{workers.text()}"
            yield workers, ranks, work
        finally:
            workers.stop()
            ranks.close()


def test_the_two_workers_live_in_different_network_namespaces(
    cluster: Cluster,
) -> None:
    workers, ranks, _ = cluster
    joined = {int(w["rank"]): int(w["pid"]) for w in ranks.joined()}  # type: ignore[call-overload]
    assert joined == {r: p.pid for r, p in enumerate(workers.processes)}, (joined, workers.text())
    spaces = [os.readlink(f"/proc/{pid}/ns/net") for pid in joined.values()]
    ours = os.readlink("/proc/self/ns/net")
    assert len(set(spaces)) == 2 and ours not in spaces, (spaces, ours)
    for host, space in zip(workers.hosts, spaces, strict=True):
        assert os.stat(f"/run/netns/{host.netns}").st_ino == int(space.strip("net:[]")), (host, space)


def test_a_stranger_on_another_host_gets_nothing_from_the_rank_store(cluster: Cluster) -> None:
    """A plain TCPStore client in a worker's namespace (what the port accepted before the gate)."""
    workers, ranks, _ = cluster
    host = workers.hosts[0]
    probe = (
        "import datetime, sys, torch.distributed as dist\n"
        f"s = dist.TCPStore('{host.trainer_ip}', {ranks.port}, is_master=False,"
        " timeout=datetime.timedelta(seconds=3))\n"
        "print(s.get('stage/posted'))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        ["ip", "netns", "exec", host.netns, sys.executable, "-c", probe],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert done.returncode != 0, done.stdout
    assert len(ranks.joined()) == 2  # the workers are still in


@pytest.mark.parametrize(("replicas", "parallel"), [(1, "ddp"), (2, "fsdp")])
def test_a_stage_on_workers_in_two_namespaces_equals_one_process_with_the_combined_batch(
    cluster: Cluster,
    reference: tuple[StageRun, StageRun],
    replicas: int,
    parallel: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=STAGE_LOGGER)
    workers, ranks, work = cluster
    before = [_bytes(h) for h in workers.hosts]
    job = small(f"netns-{parallel}", **{"stages.1.replicas": replicas, "stages.1.parallel": parallel})
    up, down = run_on_ranks(job, work, ranks)
    for run in (up, down):
        finish(run, 180)
    same_training((up, down), reference)
    # The stage's log record says where it ran: on the cluster's two ranks (each worker's host).
    running = stage_running(caplog.records, down.final.stage)
    assert [(f["ranks"], len(f["rank_hosts"])) for f in running] == [(2, 2)], running
    crossed = [_bytes(h) - b for h, b in zip(workers.hosts, before, strict=True)]
    gradients = sum(p.numel() * 4 for p in down.parameters())
    print(f"{parallel}: {crossed[0]} B over the workers' link (rank 0's end); gradients {gradients} B/step")
    # Every step each rank sends its gradients' share and receives the other's (a ddp all-reduce, or
    # fsdp's reduce-scatter and all-gather): at least the gradients' size per step at each end.
    assert min(crossed) > STEPS * gradients, (crossed, gradients)
    assert all(p.poll() is None for p in workers.processes), f"a worker exited:\n{workers.text()}"
