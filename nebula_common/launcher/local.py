"""Two (or more) simulated clusters on one machine, real processes, an emulated WAN between switches.

With three or more clusters (``nebula local up --clusters 3``: a, b, c) every switch links to every
other one (a full mesh; each switch has several peers, ``NEBULA_SWITCH_PEERS``): of each pair the id
that sorts first dials, through a WAN emulator in front of the other's WAN port (one emulator per
accepting switch, ``wan-emulator-<cluster>``; ``wan`` controls the first one's).

Per cluster: auth, codec, switch, trainer, each its own process with its own
settings, exactly as the containers run them. Between the switches sits the WAN
emulator, so every byte between clusters crosses a shaped, delayed TCP link
under mutual TLS. The layout of the run directory:

    <run>/pki/...              CAs, switch certificates, trust bundles
    <run>/pki/<cluster>/services/<service>/   each service's internal identity (ca.crt, service.crt/key)
    <run>/<cluster>/auth/      the auth service's SQLite and signing key
    <run>/<cluster>/admin-password   bootstrap admin password (0600)
    <run>/<cluster>/switch/    the switch's audit log, seal and audit key
    <run>/<cluster>/data/      the data service: accounts/<owner>/{datasets,inbox}, audit log
    <run>/<cluster>/trainer/   the trainer's data dir (stage checkpoints)
    <run>/logs/<svc>-<cluster>.log   JSON logs of each process
    <run>/logs/supervisor.jsonl      one JSON line per service death, restart or crash loop
    <run>/wan-control-token          token for the WAN emulator's control port (0600)

Every service listens on ports the launcher picks outside the kernel's ephemeral range and keeps
across restarts (``ports.py``). Starting again on an existing run directory reuses everything in it
(PKI, admin passwords, accounts, signing keys, audit keys, datasets, checkpoints) and overwrites
nothing; a partial or corrupt run
directory is refused with a message naming the file (see ``check_run_dir``). One deployment at a time
per run directory (a lock file). While it is up, a supervisor restarts any process that dies, on the
same ports (``nebula_common/launcher/supervisor.py``).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, Any

from nebula_common.clients.endpoints import ClusterEndpoints
from nebula_common.durable import atomic_write
from nebula_common.launcher import service_box
from nebula_common.launcher.addresses import SwitchPeer
from nebula_common.launcher.cluster import (
    ClusterLauncher,
    ClusterProcesses,
    cluster_endpoints,
    write_secret,
)
from nebula_common.launcher.description import describe_deployment
from nebula_common.launcher.emulator import launch_emulator
from nebula_common.launcher.pinned import LOOPBACK
from nebula_common.launcher.process import ServiceProcess
from nebula_common.launcher.renewal import LeafRenewer
from nebula_common.launcher.run_dir import LocalDeploymentError, check_run_dir, lock_run_dir
from nebula_common.launcher.supervisor import RestartPolicy, Supervisor
from nebula_common.launcher.together import start_together
from nebula_common.pki import init_pki
from nebula_common.pki.service_identity import ensure_service_certificates
from nebula_common.pki.store import PkiError
from nebula_common.rpc.internal_tls import PLAINTEXT_ENV, plaintext_allowed
from nebula_common.wan.control import WanControl

CONTROL_TOKEN_FILE = "wan-control-token"
CLUSTER_IDS = "abcdefgh"
"""Cluster ids of ``nebula local up --clusters N``: the first N letters."""
MAX_CLUSTERS = len(CLUSTER_IDS)


@dataclass
class LocalDeployment:
    run_dir: Path
    bandwidth_mbit: float = 60.0
    delay_ms: float = 20.0
    clusters: tuple[str, ...] = ("a", "b")
    log_level: str = "INFO"
    cluster_state: dict[str, ClusterProcesses] = field(default_factory=dict)
    emulator: ServiceProcess | None = None
    emulator_port: int = 0
    control_port: int = 0
    #: With three or more clusters: the WAN emulator in front of each accepting switch, by cluster
    #: (``emulator`` is the first of them), and the port each listens on.
    emulators: dict[str, ServiceProcess] = field(default_factory=dict)
    emulator_ports: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Restart dead processes while up (None: the default policy). supervise=False turns it off.
    supervise: bool = True
    restart_policy: RestartPolicy | None = None
    on_event: Callable[[dict[str, Any]], None] | None = None
    supervisor: Supervisor | None = None
    renewer: LeafRenewer | None = None
    _lock: IO[str] | None = None
    _passwords: dict[str, str | None] = field(default_factory=dict)
    # Development only (side-by-side measurements): plaintext internal ports. Requires the
    # NEBULA_INTERNAL_PLAINTEXT=1 flag in this process's environment, which the services inherit.
    internal_tls: bool = True
    _boxed: bool | None = None  # services in boxes of their own (``service_box.py``), decided at start
    # Folders each boxed trainer reads besides its own (pre-trained weights named by absolute path):
    # a local trainer's view of "the cluster's filesystem", as a compose trainer's volumes are.
    shares: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        # Absolute: a service in its box starts in its own /tmp, and a stage in its account's directory.
        self.run_dir = Path(self.run_dir).absolute()
        self.shares = tuple(Path(path).absolute() for path in self.shares)
        for path in self.shares:
            if not path.is_dir():
                raise LocalDeploymentError(f"shared folder {path}: not a directory")

    @property
    def control_token_file(self) -> Path:
        return self.run_dir / CONTROL_TOKEN_FILE

    @property
    def wan(self) -> WanControl:
        """Fault controls of the running WAN emulator: ``cut()``, ``restore()``, ``reset_connections()``."""
        if not self.control_port:
            raise LocalDeploymentError("the WAN emulator is not running")
        return WanControl.from_token_file(f"{LOOPBACK}:{self.control_port}", self.control_token_file)

    @property
    def pki_dir(self) -> Path:
        return self.run_dir / "pki"

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"

    def __enter__(self) -> LocalDeployment:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if len(set(self.clusters)) != len(self.clusters) or not 2 <= len(self.clusters) <= MAX_CLUSTERS:
            raise LocalDeploymentError(
                f"need 2 to {MAX_CLUSTERS} distinct cluster ids, got {', '.join(self.clusters) or 'none'}"
            )
        if not self.internal_tls and not plaintext_allowed():
            raise LocalDeploymentError(
                f"internal_tls=False needs the development flag {PLAINTEXT_ENV}=1 in the environment"
            )
        self._passwords = check_run_dir(self.run_dir, self.clusters)
        self._boxed = service_box.boxes_enabled()  # before anything is written
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._lock = lock_run_dir(self.run_dir)
        try:
            self._passwords = check_run_dir(self.run_dir, self.clusters)  # again, now under the lock
            self.log_dir.mkdir(exist_ok=True)
            try:
                layout = init_pki(self.pki_dir, list(self.clusters))
                # One internal identity per service: kept while good, renewed with a third of its life
                # left (checked here so a PKI problem is reported before any process starts).
                if self.internal_tls:
                    for cluster in self.clusters:
                        ensure_service_certificates(self.pki_dir, cluster)
            except PkiError as exc:
                raise LocalDeploymentError(f"PKI in {self.pki_dir}: {exc}") from None
            if not self.control_token_file.exists():
                write_secret(self.control_token_file, secrets.token_urlsafe(24))
        except BaseException:
            self._release_lock()
            raise
        try:
            # The clusters' core services need nothing of each other, nor do the trainers: they start
            # together (``together.py``); the switches in the order their WAN ports are dialled.
            start_together([partial(self._start_cluster_services, c) for c in self.clusters], "core")
            if len(self.clusters) > 2:
                self._start_mesh(layout)
            else:
                self._start_pair(layout)
            start_together([partial(self._start_trainer, c) for c in self.clusters], "trainers")
            if self.internal_tls:  # the one issuer of the services' certificates: they hold no CA key
                self.renewer = LeafRenewer(self.pki_dir, self.clusters)
                self.renewer.start()
            if self.supervise:
                self.supervisor = Supervisor(
                    self.all_processes(),
                    self.restart_policy,
                    event_log=self.log_dir / "supervisor.jsonl",
                    on_event=self.on_event,
                )
                self.supervisor.start()
        except BaseException:
            self.stop()
            raise

    def _start_pair(self, layout: Any) -> None:
        """Two clusters: the acceptor's switch, the WAN emulator in front of it, then the dialer's."""
        dialer, acceptor = sorted(self.clusters)
        # The acceptor's WAN port must exist before the emulator can forward to it.
        self._start_switch(acceptor, layout, peer_address=None)
        acceptor_wan = self.cluster_state[acceptor].switch.info["wan_port"]  # type: ignore[union-attr]
        self._start_emulator(acceptor_wan)
        self._start_switch(dialer, layout, peer_address=f"{LOOPBACK}:{self.emulator_port}")

    def _start_mesh(self, layout: Any) -> None:
        """Three or more clusters, every pair linked: of each pair the id sorting first dials the other.

        Switches start from the last id down, so each one's dial targets (ids above it) are up, each
        behind its WAN emulator, before it starts.
        """
        ordered = sorted(self.clusters)
        for cluster in reversed(ordered):
            peers = []
            for peer in ordered:
                if peer == cluster:
                    continue
                address = f"{LOOPBACK}:{self.emulator_ports[peer][0]}" if peer > cluster else None
                peers.append(SwitchPeer(peer, address, layout.cluster(cluster).trust_crl(peer)))
            state = self.cluster_state[cluster]
            self.launcher.start_switch(state, layout.cluster(cluster), peers)
            if cluster != ordered[0]:  # someone dials it: its WAN port gets an emulator in front
                wan_port = state.switch.info["wan_port"]  # type: ignore[union-attr]
                process, port, control = self._launch_emulator(wan_port, f"wan-emulator-{cluster}")
                self.emulators[cluster] = process
                self.emulator_ports[cluster] = (port, control)
        first = ordered[1]
        self.emulator = self.emulators[first]
        self.emulator_port, self.control_port = self.emulator_ports[first]

    def _start_emulator(self, acceptor_wan: int) -> None:
        """The one WAN emulator of a two-cluster deployment, in front of the acceptor's WAN port."""
        emulator = self._launch_emulator(acceptor_wan, "wan-emulator")
        self.emulator, self.emulator_port, self.control_port = emulator

    def _launch_emulator(self, acceptor_wan: int, name: str) -> tuple[ServiceProcess, int, int]:
        """The WAN emulator ``name`` in front of the acceptor's WAN port, at this deployment's shape."""
        return launch_emulator(
            name, acceptor_wan, self.bandwidth_mbit, self.delay_ms, self.control_token_file, self.log_dir
        )

    def all_processes(self) -> list[ServiceProcess]:
        """Every process of the deployment, the WAN emulator included."""
        processes = [p for state in self.cluster_state.values() for p in state.processes()]
        emulators = list(self.emulators.values()) or ([self.emulator] if self.emulator is not None else [])
        return processes + emulators

    def process(self, name: str) -> ServiceProcess:
        """A process by name: ``auth-a``, ``switch-b``, ``wan-emulator``, ..."""
        for process in self.all_processes():
            if process.name == name:
                return process
        raise LocalDeploymentError(f"no process named {name!r}")

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the descriptor releases the flock
            self._lock = None

    @property
    def launcher(self) -> ClusterLauncher:
        """Starts each cluster's services, the same way ``nebula cluster up`` starts one cluster's."""
        if self._boxed is None:
            self._boxed = service_box.boxes_enabled()
        return ClusterLauncher(
            self.run_dir,
            self.log_dir,
            self.log_level,
            pki_dir=self.pki_dir if self.internal_tls else None,
            boxed=self._boxed,
            shares=self.shares,
        )

    def _start_cluster_services(self, cluster: str) -> None:
        state = self.launcher.new_state(cluster, self._passwords.get(cluster))
        self.cluster_state[cluster] = state  # known to stop() before its first process starts
        self.launcher.start_core(state)

    def _start_switch(self, cluster: str, layout: Any, peer_address: str | None) -> None:
        peer = next(c for c in self.clusters if c != cluster)
        paths = layout.cluster(cluster)
        # One operator holds both PKIs here, so the peer's CRL is also a file next to its CA; the
        # switches exchange it over the WAN port as well (the only way between organisations).
        self.launcher.start_switch(
            self.cluster_state[cluster],
            paths,
            peer,
            peer_address=peer_address,
            peer_crl=paths.trust_crl(peer),
        )

    def _start_trainer(self, cluster: str) -> None:
        self.launcher.start_trainer(self.cluster_state[cluster])

    @staticmethod
    def address(process: ServiceProcess | None) -> str:
        return ClusterLauncher.address(process)

    @staticmethod
    def service_address(process: ServiceProcess | None) -> str:
        """host:port of a service's mutual-TLS service port (what the cluster's other services call)."""
        return ClusterLauncher.service_address(process)

    def ca_cert(self, cluster: str) -> Path:
        """The cluster CA that every internal port of ``cluster`` is verified against."""
        return self.pki_dir / cluster / "ca.crt"

    def data_address(self, cluster: str) -> str:
        """host:port of ``cluster``'s data service (datasets, grants, ReadBatch)."""
        return self.address(self.cluster_state[cluster].data)

    def endpoints(self, cluster: str) -> ClusterEndpoints:
        return cluster_endpoints(self.cluster_state[cluster])

    @property
    def boxed(self) -> bool:
        """Whether the services run in boxes of their own (decided at start)."""
        return bool(self._boxed)

    def describe(self) -> dict[str, Any]:
        """Everything an operator needs to poke at the running deployment (``description.py``)."""
        return describe_deployment(self)

    def stop(self) -> None:
        """Stop trainers first (they close their edges), then switches, emulators, data, codec, auth, signer.

        Every process is marked unwanted before any is signalled, so the supervisor restarts nothing
        while the deployment goes down; its thread ends last, because a service it restarted gets the
        parent-death signal when that thread ends (bubblewrap's ``--die-with-parent``, ``setpriv``), which
        would kill it before its graceful stop. The processes of one kind (every cluster's trainer, ...)
        stop together: one after another, 11 graceful exits took 55 s at load 25, close to `local down`'s
        and the tests' limits.
        """
        if self.renewer is not None:
            self.renewer.stop()
        for process in self.all_processes():
            with process.lock:
                process.wanted = False

        def every(attr: str) -> list[ServiceProcess]:
            return [getattr(s, attr) for s in self.cluster_state.values() if getattr(s, attr) is not None]

        emulators = list(self.emulators.values()) or ([self.emulator] if self.emulator is not None else [])
        tiers = [every("trainer"), every("switch"), emulators, every("data"), every("codec"), every("auth")]
        tiers.append(every("signer"))  # last: the others seal their audit logs as they stop
        try:
            for tier in tiers:
                with ThreadPoolExecutor(max_workers=max(1, len(tier)), thread_name_prefix="stop") as pool:
                    list(pool.map(ServiceProcess.stop, tier))  # each: SIGTERM, then SIGKILL after 15 s
            for state in self.cluster_state.values():
                if state.trainer_box is not None:
                    state.trainer_box.release()
        finally:
            if self.supervisor is not None:
                self.supervisor.stop()
            self._release_lock()

    def write_description(self, path: Path) -> None:
        atomic_write(path, json.dumps(self.describe(), indent=2).encode(), mode=0o644)
