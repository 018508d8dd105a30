"""Two (or more) simulated clusters on one machine, real processes, an emulated WAN between switches.

Per cluster: auth, codec, switch, trainer, each its own process with its own
settings, exactly as the containers run them. Between the switches sits the WAN
emulator, so every byte between clusters crosses a shaped, delayed TCP link
under mutual TLS. The layout of the run directory:

    <run>/pki/...              CAs, switch certificates, trust bundles
    <run>/<cluster>/auth/      the auth service's SQLite and signing key
    <run>/<cluster>/admin-password   bootstrap admin password (0600)
    <run>/<cluster>/switch/    the switch's audit log, seal and audit key
    <run>/<cluster>/data/      the data service: accounts/<owner>/{datasets,inbox}, audit log
    <run>/<cluster>/trainer/   the trainer's data dir (stage checkpoints)
    <run>/logs/<svc>-<cluster>.log   JSON logs of each process
"""

from __future__ import annotations

import json
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nebula_common.clients.endpoints import ClusterEndpoints
from nebula_common.durable import atomic_write
from nebula_common.errors import NebulaError
from nebula_common.launcher.process import ServiceProcess, ServiceStartError, console_command, wait_healthy
from nebula_common.pki import init_pki

LOOPBACK = "127.0.0.1"


class LocalDeploymentError(NebulaError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _write_secret(path: Path, value: str) -> None:
    """Write a secret file readable by its owner only (0600 even if the file already existed)."""
    atomic_write(path, value.encode(), mode=0o600)


@dataclass
class ClusterProcesses:
    cluster_id: str
    admin_password: str
    auth: ServiceProcess | None = None
    codec: ServiceProcess | None = None
    switch: ServiceProcess | None = None
    trainer: ServiceProcess | None = None
    data: ServiceProcess | None = None

    def processes(self) -> list[ServiceProcess]:
        return [p for p in (self.auth, self.codec, self.data, self.switch, self.trainer) if p is not None]


@dataclass
class LocalDeployment:
    run_dir: Path
    bandwidth_mbit: float = 60.0
    delay_ms: float = 20.0
    clusters: tuple[str, str] = ("a", "b")
    log_level: str = "INFO"
    cluster_state: dict[str, ClusterProcesses] = field(default_factory=dict)
    emulator: ServiceProcess | None = None
    emulator_port: int = 0

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
        if len(set(self.clusters)) != 2:
            raise LocalDeploymentError(f"need two distinct cluster ids, got {self.clusters}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(exist_ok=True)
        layout = init_pki(self.pki_dir, list(self.clusters))
        try:
            for cluster in self.clusters:
                self._start_cluster_services(cluster)
            dialer, acceptor = sorted(self.clusters)
            # The acceptor's WAN port must exist before the emulator can forward to it.
            self._start_switch(acceptor, layout, peer_address=None)
            self.emulator_port = free_port()
            acceptor_wan = self.cluster_state[acceptor].switch.info["wan_port"]  # type: ignore[union-attr]
            self.emulator = ServiceProcess(
                name="wan-emulator",
                command=console_command(
                    "nebula_common.cli.app",
                    "wan",
                    "emulate",
                    "--listen",
                    f"{LOOPBACK}:{self.emulator_port}",
                    "--target",
                    f"{LOOPBACK}:{acceptor_wan}",
                    "--bandwidth-mbit",
                    str(self.bandwidth_mbit),
                    "--delay-ms",
                    str(self.delay_ms),
                ),
                env={},
                log_dir=self.log_dir,
            )
            self.emulator.start()
            self._wait_listening(self.emulator, self.emulator_port)
            self._start_switch(dialer, layout, peer_address=f"{LOOPBACK}:{self.emulator_port}")
            for cluster in self.clusters:
                self._start_trainer(cluster)
        except BaseException:
            self.stop()
            raise

    def _start_cluster_services(self, cluster: str) -> None:
        password = secrets.token_urlsafe(18)
        cluster_dir = self.run_dir / cluster
        (cluster_dir / "auth").mkdir(parents=True, exist_ok=True)
        password_file = cluster_dir / "admin-password"
        _write_secret(password_file, password)
        state = ClusterProcesses(cluster_id=cluster, admin_password=password)
        self.cluster_state[cluster] = state
        common = {"LOG_LEVEL": self.log_level}
        state.auth = self._launch(
            f"auth-{cluster}",
            "services.auth",
            "NEBULA_AUTH_",
            {
                **common,
                "CLUSTER_ID": cluster,
                "LISTEN": f"{LOOPBACK}:0",
                "DATA_DIR": str(cluster_dir / "auth"),
                "ADMIN_PASSWORD_FILE": str(password_file),
            },
        )
        wait_healthy(self.address(state.auth), "nebula.v1.Auth")
        # Codec and data check tokens with auth's keys, fetched at start-up, so they follow auth.
        state.codec = self._launch(
            f"codec-{cluster}",
            "services.codec",
            "NEBULA_CODEC_",
            {**common, "CLUSTER_ID": cluster, "AUTH_ADDRESS": self.address(state.auth)},
        )
        wait_healthy(self.address(state.codec), "nebula.v1.Codec")
        state.data = self._launch(
            f"data-{cluster}",
            "services.data",
            "NEBULA_DATA_",
            {
                **common,
                "CLUSTER_ID": cluster,
                "LISTEN": f"{LOOPBACK}:0",
                "AUTH_ADDRESS": self.address(state.auth),
                "DATA_DIR": str(cluster_dir / "data"),
            },
        )
        wait_healthy(self.address(state.data), "nebula.v1.Data")

    def _start_switch(self, cluster: str, layout: Any, peer_address: str | None) -> None:
        peer = next(c for c in self.clusters if c != cluster)
        paths = layout.cluster(cluster)
        state = self.cluster_state[cluster]
        env = {
            "LOG_LEVEL": self.log_level,
            "CLUSTER_ID": cluster,
            "PEER_CLUSTER_ID": peer,
            "INTERNAL_LISTEN": f"{LOOPBACK}:0",
            "WAN_LISTEN": f"{LOOPBACK}:0",
            "TLS_CERT": str(paths.switch_cert),
            "TLS_KEY": str(paths.switch_key),
            "TRUST_BUNDLE": str(paths.trust_bundle),
            "AUTH_ADDRESS": self.address(state.auth),
            "DATA_DIR": str(self.run_dir / cluster / "switch"),
            "PEER_CRL": str(paths.trust_crl(peer)),
            # Dev PKI on one machine: the switch may renew itself from its CA before expiry.
            "CA_CERT": str(paths.ca_cert),
            "CA_KEY": str(paths.ca_key),
        }
        if peer_address is not None:
            env["PEER_ADDRESS"] = peer_address
        state.switch = self._launch(f"switch-{cluster}", "services.switch", "NEBULA_SWITCH_", env)
        wait_healthy(f"{LOOPBACK}:{state.switch.info['internal_port']}", "nebula.v1.Relay")

    def _start_trainer(self, cluster: str) -> None:
        state = self.cluster_state[cluster]
        state.trainer = self._launch(
            f"trainer-{cluster}",
            "services.trainer",
            "NEBULA_TRAINER_",
            {
                "LOG_LEVEL": self.log_level,
                "CLUSTER_ID": cluster,
                "LISTEN": f"{LOOPBACK}:0",
                "SWITCH_ADDRESS": f"{LOOPBACK}:{state.switch.info['internal_port']}",  # type: ignore[union-attr]
                "AUTH_ADDRESS": self.address(state.auth),
                "DATA_DIR": str(self.run_dir / cluster / "trainer"),
                "DATA_SERVICE_ADDRESS": self.data_address(cluster),
            },
        )
        wait_healthy(self.address(state.trainer), "nebula.v1.Trainer")

    def _launch(self, name: str, module: str, prefix: str, settings: dict[str, str]) -> ServiceProcess:
        process = ServiceProcess(
            name=name,
            command=console_command(module),
            env={prefix + key: value for key, value in settings.items()},
            log_dir=self.log_dir,
        )
        process.start()
        process.wait_ready()
        return process

    @staticmethod
    def _wait_listening(process: ServiceProcess, port: int, timeout: float = 30.0) -> None:
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.popen is not None and process.popen.poll() is not None:
                raise ServiceStartError(f"{process.name} exited during start-up:\n{process.tail()}")
            with socket.socket() as sock:
                if sock.connect_ex((LOOPBACK, port)) == 0:
                    return
            time.sleep(0.05)
        raise ServiceStartError(f"{process.name} not listening on {port} within {timeout:.0f}s")

    @staticmethod
    def address(process: ServiceProcess | None) -> str:
        if process is None:
            raise LocalDeploymentError("service not started")
        return f"{LOOPBACK}:{process.info['grpc_port']}"

    def data_address(self, cluster: str) -> str:
        """host:port of ``cluster``'s data service (datasets, grants, ReadBatch)."""
        return self.address(self.cluster_state[cluster].data)

    def endpoints(self, cluster: str) -> ClusterEndpoints:
        state = self.cluster_state[cluster]
        metrics = {
            p.name: f"http://{LOOPBACK}:{p.info['metrics_port']}/metrics"
            for p in state.processes()
            if (p.info.get("metrics_port") or -1) > 0
        }
        return ClusterEndpoints(
            cluster_id=cluster,
            auth=self.address(state.auth),
            trainer=self.address(state.trainer),
            switch=f"{LOOPBACK}:{state.switch.info['internal_port']}",  # type: ignore[union-attr]
            metrics=metrics,
            codec=self.address(state.codec),
        )

    def describe(self) -> dict[str, Any]:
        """Everything an operator needs to poke at the running deployment."""
        clusters = {}
        for cluster, state in self.cluster_state.items():
            clusters[cluster] = {
                "processes": {
                    p.name: {**p.info, "pid": p.popen.pid if p.popen else None} for p in state.processes()
                },
                "admin_password_file": str(self.run_dir / cluster / "admin-password"),
            }
        return {
            "run_dir": str(self.run_dir),
            "pki_dir": str(self.pki_dir),
            "log_dir": str(self.log_dir),
            "wan_emulator": {
                "port": self.emulator_port,
                "bandwidth_mbit": self.bandwidth_mbit,
                "delay_ms": self.delay_ms,
            },
            "clusters": clusters,
        }

    def stop(self) -> None:
        """Stop trainers first (they close their edges), then switches, emulator, codec, auth."""
        order: list[ServiceProcess] = []
        for attr in ("trainer", "switch"):
            order += [getattr(s, attr) for s in self.cluster_state.values() if getattr(s, attr) is not None]
        if self.emulator is not None:
            order.append(self.emulator)
        for attr in ("data", "codec", "auth"):
            order += [getattr(s, attr) for s in self.cluster_state.values() if getattr(s, attr) is not None]
        for process in order:
            process.stop()

    def write_description(self, path: Path) -> None:
        path.write_text(json.dumps(self.describe(), indent=2))
