"""``nebula cluster up``: one organisation's cluster, its own PKI, its switch pointed at its peer(s).

A cluster in the middle of a chain has several peers (``--peer b=HOST:PORT --peer c=HOST:PORT``): its
switch links to each (``NEBULA_SWITCH_PEERS``), and its PKI must trust each peer's CA.

Two organisations each run this on their own machines; nothing is shared but the CA certificates
they exchanged (``nebula pki export-ca`` / ``trust add``) and one WAN port. The run directory holds
only this organisation's material:

    <run>/pki/<cluster>/...          its CA, switch certificate, CRL, and the peer CAs it trusts
    <run>/<cluster>/{auth,switch,data,trainer}/, admin-password
    <run>/logs/<svc>-<cluster>.log, supervisor.jsonl
    <run>/deployment.json            pids and ports while up

The peer's CRL is not a file here: the switch receives it over the WAN port and keeps it in its data
directory. ``nebula local down``/``status`` work on this run directory too (same lock file).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from nebula_common.clients.endpoints import ClusterEndpoints
from nebula_common.durable import atomic_write
from nebula_common.launcher import service_box
from nebula_common.launcher.addresses import ClusterDeploymentError, SwitchPeer, parse_host_port
from nebula_common.launcher.cluster import ClusterLauncher, ClusterProcesses, cluster_endpoints
from nebula_common.launcher.renewal import LeafRenewer
from nebula_common.launcher.run_dir import check_run_dir, lock_run_dir
from nebula_common.launcher.supervisor import RestartPolicy, Supervisor
from nebula_common.pki.service_identity import MONITORING_ROLE, service_tls_dir
from nebula_common.pki.store import ClusterPaths, PkiError, load_layout


def check_organisation_pki(pki_dir: Path, cluster: str, peer: str) -> ClusterPaths:
    """The cluster's own PKI, complete and trusting ``peer``; otherwise an error saying what to run."""
    paths = ClusterPaths.for_cluster(pki_dir, cluster)
    if not paths.ca_cert.is_file():
        raise ClusterDeploymentError(
            f"no PKI for cluster {cluster!r} in {pki_dir}: run `nebula pki init --dir {pki_dir} --cluster "
            f"{cluster}`, then exchange CA certificates with {peer!r} (see docs/runbook-peer-organisation.md)"
        )
    if not paths.trust_cert(peer).is_file():
        raise ClusterDeploymentError(
            f"cluster {cluster!r} does not trust peer {peer!r} yet: get its CA certificate and "
            "fingerprint, then "
            f"`nebula pki trust add --dir {pki_dir} --cluster {cluster} --peer {peer} --ca {peer}-ca.crt "
            "--fingerprint SHA256:...`"
        )
    try:
        load_layout(pki_dir, [cluster])
    except PkiError as exc:
        raise ClusterDeploymentError(f"PKI in {pki_dir}: {exc}") from None
    return paths


@dataclass
class ClusterDeployment:
    """``nebula cluster up``: one organisation's cluster, its switch pointed at one peer."""

    run_dir: Path
    cluster: str
    peer: str
    peer_address: str | None
    wan_listen: str
    pki_dir: Path | None = None
    #: Further peers (cluster id, WAN address or None to only accept its link), one switch link each.
    more_peers: tuple[tuple[str, str | None], ...] = ()
    log_level: str = "INFO"
    supervise: bool = True
    restart_policy: RestartPolicy | None = None
    on_event: Callable[[dict[str, Any]], None] | None = None
    state: ClusterProcesses | None = None
    supervisor: Supervisor | None = None
    renewer: LeafRenewer | None = None
    _lock: IO[str] | None = field(default=None, repr=False)
    _boxed: bool | None = field(default=None, repr=False)  # services boxed (``service_box.py``)
    shares: tuple[Path, ...] = ()  # folders the boxed trainer reads besides its own (``trainer_box.py``)

    @property
    def pki(self) -> Path:
        return self.pki_dir if self.pki_dir is not None else self.run_dir / "pki"

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"

    def __enter__(self) -> ClusterDeployment:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def peers(self) -> list[tuple[str, str | None]]:
        """Every peer: (cluster id, WAN address or None)."""
        return [(self.peer, self.peer_address), *self.more_peers]

    def start(self) -> None:
        ids = [peer for peer, _ in self.peers]
        if self.cluster in ids:
            raise ClusterDeploymentError(f"--peer must name another cluster than {self.cluster!r}")
        if len(set(ids)) != len(ids):
            raise ClusterDeploymentError(f"--peer names a cluster twice: {', '.join(ids)}")
        parse_host_port(self.wan_listen, "--wan-listen")
        for peer in ids:
            paths = check_organisation_pki(self.pki, self.cluster, peer)
        passwords = check_run_dir(self.run_dir, (self.cluster,))
        self._boxed = boxed = service_box.boxes_enabled()  # before anything is written
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._lock = lock_run_dir(self.run_dir)
        self.log_dir.mkdir(exist_ok=True)
        # Every internal port serves mutual TLS with identities from this organisation's own CA.
        launcher = ClusterLauncher(
            self.run_dir, self.log_dir, self.log_level, pki_dir=self.pki, boxed=boxed, shares=self.shares
        )
        try:
            self.state = launcher.new_state(self.cluster, passwords.get(self.cluster))
            launcher.start_core(self.state)
            if self.more_peers:
                peers = [SwitchPeer(peer, address) for peer, address in self.peers]
                launcher.start_switch(self.state, paths, peers, wan_listen=self.wan_listen)
            else:
                launcher.start_switch(
                    self.state, paths, self.peer, peer_address=self.peer_address, wan_listen=self.wan_listen
                )
            launcher.start_trainer(self.state)
            # The one issuer of this organisation's certificates: no service holds the CA key.
            self.renewer = LeafRenewer(self.pki, [self.cluster])
            self.renewer.start()
            if self.supervise:
                self.supervisor = Supervisor(
                    self.state.processes(),
                    self.restart_policy,
                    event_log=self.log_dir / "supervisor.jsonl",
                    on_event=self.on_event,
                )
                self.supervisor.start()
        except BaseException:
            self.stop()
            raise

    def endpoints(self) -> ClusterEndpoints:
        if self.state is None:
            raise ClusterDeploymentError("the cluster is not running")
        return cluster_endpoints(self.state)

    def describe(self) -> dict[str, Any]:
        supervision = self.supervisor.status() if self.supervisor is not None else {}
        processes = {}
        for p in self.state.processes() if self.state is not None else []:
            status = supervision.get(p.name, {"state": "running", "restarts": 0, "last_exit": None})
            processes[p.name] = {**p.info, "pid": p.pid, **status}
        return {
            # Which command holds the run directory's lock (``nebula local status|down`` name it).
            "command": {"name": "nebula cluster up", "pid": os.getpid()},
            "run_dir": str(self.run_dir),
            "pki_dir": str(self.pki),
            "log_dir": str(self.log_dir),
            "service_isolation": service_box.describe(bool(self._boxed)),
            "peer": {"cluster": self.peer, "address": self.peer_address},
            **(
                {"peers": [{"cluster": peer, "address": address} for peer, address in self.peers]}
                if self.more_peers
                else {}
            ),
            "wan_listen": self.wan_listen,
            "clusters": {
                self.cluster: {
                    "processes": processes,
                    "admin_password_file": str(self.run_dir / self.cluster / "admin-password"),
                    # Every internal port of the cluster serves TLS verified against this CA.
                    "ca_cert": str(self.pki / self.cluster / "ca.crt"),
                    "monitoring_tls": str(service_tls_dir(self.pki, self.cluster, MONITORING_ROLE)),
                }
            },
        }

    def write_description(self, path: Path) -> None:
        atomic_write(path, json.dumps(self.describe(), indent=2).encode(), mode=0o644)

    def stop(self) -> None:
        """Trainer, switch, then data, codec, auth; nothing is restarted while going down (every process
        is unwanted first), and the supervisor's thread ends last (``LocalDeployment.stop`` says why)."""
        if self.renewer is not None:
            self.renewer.stop()
        state = self.state
        try:
            if state is not None:
                for process in state.processes():
                    with process.lock:
                        process.wanted = False
                for process in [
                    state.trainer,
                    state.switch,
                    state.data,
                    state.codec,
                    state.auth,
                    state.signer,
                ]:
                    if process is not None:
                        process.stop()
                if state.trainer_box is not None:
                    state.trainer_box.release()
        finally:
            if self.supervisor is not None:
                self.supervisor.stop()
            if self._lock is not None:
                self._lock.close()
                self._lock = None
