"""What ``nebula local up`` tells an operator about a running deployment: every process with its pid,
state and restarts, the run directory's files to read, the WAN emulators' ports and controls.

Written to the run directory (``deployment.json``) and read by ``nebula local status|down``, the tests
and the benches, so it is the deployment's one public description."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from nebula_common.launcher import service_box
from nebula_common.launcher.cluster import ClusterProcesses
from nebula_common.launcher.pinned import LOOPBACK
from nebula_common.launcher.process import ServiceProcess
from nebula_common.launcher.supervisor import Supervisor
from nebula_common.pki.service_identity import MONITORING_ROLE


class Deployment(Protocol):
    """What the description reads of a deployment (``local.LocalDeployment``)."""

    run_dir: Path
    pki_dir: Path
    log_dir: Path
    control_token_file: Path
    bandwidth_mbit: float
    delay_ms: float
    cluster_state: dict[str, ClusterProcesses]
    emulator: ServiceProcess | None
    emulator_port: int
    control_port: int
    emulators: dict[str, ServiceProcess]
    emulator_ports: dict[str, tuple[int, int]]
    supervisor: Supervisor | None
    internal_tls: bool
    boxed: bool
    shares: tuple[Path, ...]

    def ca_cert(self, cluster: str) -> Path: ...


def describe_deployment(self: Deployment) -> dict[str, Any]:
    """Everything an operator needs to poke at the running deployment (pids, restarts, ports)."""
    supervision = self.supervisor.status() if self.supervisor is not None else {}

    def entry(p: ServiceProcess) -> dict[str, Any]:
        status = supervision.get(p.name, {"state": "running", "restarts": 0, "last_exit": None})
        return {**p.info, "pid": p.pid, **status}

    clusters = {}
    for cluster, state in self.cluster_state.items():
        clusters[cluster] = {
            "processes": {p.name: entry(p) for p in state.processes()},
            "admin_password_file": str(self.run_dir / cluster / "admin-password"),
            # The trainer's stage records: `nebula job list` reads them once the deployment stopped.
            "trainer_data_dir": str(self.run_dir / cluster / "trainer"),
        }
        if self.internal_tls:  # every internal port of the cluster serves TLS verified against this CA
            clusters[cluster]["ca_cert"] = str(self.ca_cert(cluster))
            # The scraper's identity (role monitoring): /metrics refuse readers without it.
            scraper = state.service_tls.get(MONITORING_ROLE)
            if scraper is not None:
                clusters[cluster]["monitoring_tls"] = str(scraper.dir)
    emulator = entry(self.emulator) if self.emulator is not None else {}
    return {
        # Which command holds the run directory's lock (``nebula local status|down`` name it).
        "command": {"name": "nebula local up", "pid": os.getpid()},
        "run_dir": str(self.run_dir),
        "pki_dir": str(self.pki_dir),
        "service_isolation": service_box.describe(self.boxed),
        "trainer_shares": [str(path) for path in self.shares],
        "log_dir": str(self.log_dir),
        "supervisor_log": str(self.log_dir / "supervisor.jsonl"),
        "wan_emulator": {
            "port": self.emulator_port,
            "bandwidth_mbit": self.bandwidth_mbit,
            "delay_ms": self.delay_ms,
            "control": f"{LOOPBACK}:{self.control_port}",
            "control_token_file": str(self.control_token_file),
            "pid": emulator.get("pid"),
            "state": emulator.get("state"),
            "restarts": emulator.get("restarts", 0),
        },
        **_describe_mesh(self, entry),
        "clusters": clusters,
    }


def _describe_mesh(self: Deployment, entry: Callable[[ServiceProcess], dict[str, Any]]) -> dict[str, Any]:
    """With three or more clusters: the emulator in front of each accepting switch (by cluster)."""
    if not self.emulators:
        return {}
    mesh = {}
    for cluster, process in self.emulators.items():
        port, control = self.emulator_ports[cluster]
        info = entry(process)
        mesh[cluster] = {
            "port": port,
            "control": f"{LOOPBACK}:{control}",
            "pid": info.get("pid"),
            "state": info.get("state"),
            "restarts": info.get("restarts", 0),
        }
    return {"wan_emulators": mesh}
