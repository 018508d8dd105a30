"""One cluster's services as processes: auth, codec, data, switch, trainer, in start order.

``ClusterLauncher`` starts them, each with its own settings, exactly as the containers run them;
``nebula local up`` uses it twice (with the WAN emulator between the switches, ``local.py``) and
``nebula cluster up`` once (one organisation, ``organisation.py``). The switch is always given its
own CA's CRL to send to the peer over the WAN port (services/switch/crl_exchange.py).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from nebula_common.clients.endpoints import ClusterEndpoints
from nebula_common.durable import atomic_write
from nebula_common.launcher.addresses import ClusterDeploymentError, SwitchPeer
from nebula_common.launcher.edge_socket import edge_socket_path
from nebula_common.launcher.pinned import LOOPBACK, launch_pinned
from nebula_common.launcher.process import ServiceProcess, wait_healthy
from nebula_common.launcher.service_box import ServiceBox, boxes_enabled, for_service
from nebula_common.launcher.signer import SignerLayout, signer_layout
from nebula_common.launcher.together import start_together
from nebula_common.launcher.trainer_box import TrainerBox
from nebula_common.metrics import metrics_url, trust_metrics_endpoint
from nebula_common.pki.service_identity import (
    MONITORING_ROLE,
    ServiceTlsFiles,
    ensure_service_certificates,
    mirror_crl,
)
from nebula_common.pki.store import ClusterPaths
from nebula_common.rpc.internal_tls import ClientTls, trust_endpoint

# Ready-line port -> the setting that binds it. The launcher picks each port (outside the ephemeral
# range, ``ports.py``) and keeps it in the service's env, so a restart comes back on the same port.
LISTEN_PINS = {"grpc_port": "LISTEN", "service_port": "SERVICE_LISTEN", "metrics_port": "METRICS_PORT"}
SWITCH_PINS = {
    "internal_port": "INTERNAL_LISTEN",
    "service_port": "SERVICE_LISTEN",
    "wan_port": "WAN_LISTEN",
    "metrics_port": "METRICS_PORT",
}


def write_secret(path: Path, value: str) -> None:
    """Write a secret file readable by its owner only (0600 even if the file already existed)."""
    atomic_write(path, value.encode(), mode=0o600)


@dataclass
class ClusterProcesses:
    cluster_id: str
    admin_password: str
    signer: ServiceProcess | None = None
    auth: ServiceProcess | None = None
    codec: ServiceProcess | None = None
    switch: ServiceProcess | None = None
    trainer: ServiceProcess | None = None
    data: ServiceProcess | None = None
    # Each service's internal identity (``pki/service_identity.py``); empty when internal TLS is off.
    service_tls: dict[str, ServiceTlsFiles] = field(default_factory=dict)
    # Where the audit signer keeps its keys and each service's socket (``launcher/signer.py``).
    signing: SignerLayout | None = None
    # The trainer's box (``trainer_box.py``): its control-group folders go once it has stopped.
    trainer_box: TrainerBox | None = None

    def processes(self) -> list[ServiceProcess]:
        every = (self.signer, self.auth, self.codec, self.data, self.switch, self.trainer)
        return [p for p in every if p is not None]


@dataclass
class ClusterLauncher:
    """Starts one cluster's services under ``run_dir`` (state in ``run_dir/<cluster>``), in order."""

    run_dir: Path
    log_dir: Path
    log_level: str = "INFO"
    # The PKI root holding ``<cluster>/ca.crt`` and ``ca.key``; the cluster CA issues every service's
    # internal identity. None turns internal TLS off (the development flag, ``rpc/internal_tls.py``).
    pki_dir: Path | None = None
    # Each service in a bubblewrap box of its own (``service_box.py``, the trainer's: ``trainer_box.py``);
    # None: where bubblewrap can (decided at the first start).
    boxed: bool | None = None
    # Folders a boxed trainer reads besides its own (pre-trained weights named by absolute path).
    shares: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        # Absolute: a boxed service starts in its own /tmp (relative paths would point there).
        self.run_dir, self.log_dir = Path(self.run_dir).absolute(), Path(self.log_dir).absolute()
        self.shares = tuple(Path(path).absolute() for path in self.shares)
        if self.pki_dir is not None:
            self.pki_dir = Path(self.pki_dir).absolute()

    @staticmethod
    def address(process: ServiceProcess | None) -> str:
        if process is None:
            raise ClusterDeploymentError("service not started")
        return f"{LOOPBACK}:{process.info['grpc_port']}"

    @staticmethod
    def service_address(process: ServiceProcess | None) -> str:
        """host:port of a service's mutual-TLS service port (what the cluster's other services call)."""
        if process is None:
            raise ClusterDeploymentError("service not started")
        return f"{LOOPBACK}:{process.info['service_port']}"

    def _tls_settings(self, state: ClusterProcesses, service: str) -> dict[str, str]:
        """Where ``service`` finds its internal identity (never the CA key: the launcher renews it)."""
        if not state.service_tls or self.pki_dir is None:
            return {}
        return {
            "INTERNAL_TLS_DIR": str(state.service_tls[service].dir),
            # The cluster CA's CRL: `nebula pki revoke` refuses a service leaf on every internal port.
            # The launcher's copy in the service's own directory (``mirror_crl``), which its box shows.
            "INTERNAL_CRL": str(state.service_tls[service].dir / "crl.pem"),
        }

    def _signer_settings(self, state: ClusterProcesses, service: str) -> dict[str, str]:
        """Where ``service`` has its audit seals signed (it holds no audit key itself)."""
        return {"AUDIT_SIGNER": state.signing.target(service)} if state.signing is not None else {}

    def _box(
        self,
        state: ClusterProcesses,
        service: str,
        state_dir: Path | None = None,
        files: tuple[Path, ...] = (),
        pki: ClusterPaths | None = None,
        writable: tuple[Path, ...] = (),
    ) -> ServiceBox | None:
        """``service``'s box (``service_box.for_service``), or None where services run unboxed."""
        if self.boxed is None:
            self.boxed = boxes_enabled()
        if not self.boxed:
            return None
        own = state.service_tls[service].dir if service in state.service_tls else None
        if self.pki_dir is None or service != "switch":
            pki = None  # only the switch sees its cluster's PKI directory, and only with TLS on
        elif pki is None:
            pki = ClusterPaths.for_cluster(self.pki_dir, state.cluster_id)
        return for_service(service, own, pki, state_dir, files, writable)

    def _trust(self, state: ClusterProcesses, process: ServiceProcess) -> None:
        """Let this process's clients (health checks, SDK, CLI) verify ``process``'s ports."""
        if not state.service_tls or self.pki_dir is None:
            return
        tls = ClientTls(state.cluster_id, self.pki_dir / state.cluster_id / "ca.crt")
        for key in ("grpc_port", "internal_port", "service_port"):
            port = process.info.get(key)
            if isinstance(port, int) and port > 0:
                trust_endpoint(f"{LOOPBACK}:{port}", tls)
        scraper = state.service_tls.get(MONITORING_ROLE)
        port = process.info.get("metrics_port")
        if scraper is not None and process.info.get("metrics_scheme") == "https" and isinstance(port, int):
            service = process.name.removesuffix(f"-{state.cluster_id}")
            trust_metrics_endpoint(f"{LOOPBACK}:{port}", scraper, state.cluster_id, service)

    def new_state(self, cluster: str, password: str | None) -> ClusterProcesses:
        """The cluster's (not yet started) processes, with its admin password (written if new)."""
        password_file = self.run_dir / cluster / "admin-password"
        (self.run_dir / cluster / "auth").mkdir(parents=True, exist_ok=True)
        if password is None:  # a new cluster; an existing password file is never rewritten
            password = secrets.token_urlsafe(18)
            write_secret(password_file, password)
        state = ClusterProcesses(cluster_id=cluster, admin_password=password)
        if self.pki_dir is not None:
            # One internal identity per service: kept while good, renewed with a third of its life left.
            state.service_tls = ensure_service_certificates(self.pki_dir, cluster)
            mirror_crl(self.pki_dir, cluster)  # kept current by the renewer while the cluster runs
        return state

    def start_core(self, state: ClusterProcesses) -> None:
        """Auth, then codec and data (they check tokens with auth's keys, fetched at start-up).

        Each process is put into ``state`` as soon as it runs, so a caller that stops ``state``
        after a failure stops everything that was started.
        """
        cluster = state.cluster_id
        cluster_dir = self.run_dir / cluster
        password_file = cluster_dir / "admin-password"
        common = {"LOG_LEVEL": self.log_level}
        self.start_signer(state)
        state.auth = self.launch(
            f"auth-{cluster}",
            "services.auth",
            "NEBULA_AUTH_",
            {
                **common,
                "CLUSTER_ID": cluster,
                "DATA_DIR": str(cluster_dir / "auth"),
                "ADMIN_PASSWORD_FILE": str(password_file),
                **self._tls_settings(state, "auth"),
                **self._signer_settings(state, "auth"),
            },
            LISTEN_PINS,
            box=self._box(state, "auth", cluster_dir / "auth", (password_file,)),
        )
        self._trust(state, state.auth)
        wait_healthy(self.address(state.auth), "nebula.v1.Auth")
        # Codec and data need only auth: they start together (``together.py``).
        start_together([partial(self._start_codec, state), partial(self._start_data, state)], cluster)

    def _start_codec(self, state: ClusterProcesses) -> None:
        cluster = state.cluster_id
        state.codec = self.launch(
            f"codec-{cluster}",
            "services.codec",
            "NEBULA_CODEC_",
            {
                "LOG_LEVEL": self.log_level,
                "CLUSTER_ID": cluster,
                "AUTH_ADDRESS": self.service_address(state.auth),
                **self._tls_settings(state, "codec"),
            },
            LISTEN_PINS,
            box=self._box(state, "codec"),
        )
        self._trust(state, state.codec)
        wait_healthy(self.address(state.codec), "nebula.v1.Codec")

    def _start_data(self, state: ClusterProcesses) -> None:
        cluster = state.cluster_id
        cluster_dir = self.run_dir / cluster
        state.data = self.launch(
            f"data-{cluster}",
            "services.data",
            "NEBULA_DATA_",
            {
                "LOG_LEVEL": self.log_level,
                "CLUSTER_ID": cluster,
                "AUTH_ADDRESS": self.service_address(state.auth),
                "DATA_DIR": str(cluster_dir / "data"),
                **self._tls_settings(state, "data"),
                **self._signer_settings(state, "data"),
            },
            LISTEN_PINS,
            box=self._box(state, "data", cluster_dir / "data"),
        )
        self._trust(state, state.data)
        wait_healthy(self.address(state.data), "nebula.v1.Data")

    def start_signer(self, state: ClusterProcesses) -> None:
        """The audit signer, first: every other service asks it for its seals from its first record on."""
        cluster = state.cluster_id
        state.signing = signer_layout(self.run_dir, cluster)
        if self.boxed is None:
            self.boxed = boxes_enabled()
        state.signer = self.launch(
            f"signer-{cluster}",
            "services.signer",
            "NEBULA_SIGNER_",
            {
                "LOG_LEVEL": self.log_level,
                "CLUSTER_ID": cluster,
                "DATA_DIR": str(state.signing.keys),
                "SOCKETS": state.signing.setting(),
                "METRICS_PORT": "-1",
            },
            {},
            box=state.signing.box() if self.boxed else None,
        )

    def start_switch(
        self,
        state: ClusterProcesses,
        paths: ClusterPaths,
        peer: str | Sequence[SwitchPeer],
        *,
        peer_address: str | None = None,
        peer_crl: Path | None = None,
        wan_listen: str | None = None,
    ) -> None:
        """The switch: its own certificate, the peer CAs it trusts, its own CRL to send to the peer.

        ``peer`` is the one peer's cluster id (with ``peer_address`` and ``peer_crl``), or every peer of
        a switch with several (a chain across more than two clusters), one link each.
        """
        cluster = state.cluster_id
        if isinstance(peer, str):
            peer_env = {"PEER_CLUSTER_ID": peer}
        else:
            if peer_address is not None or peer_crl is not None:
                raise ClusterDeploymentError("give peer addresses and CRLs in each SwitchPeer")
            peer_env = {"PEERS": json.dumps([each.setting() for each in peer])}
        env = {
            "LOG_LEVEL": self.log_level,
            "CLUSTER_ID": cluster,
            **peer_env,
            "TLS_CERT": str(paths.switch_cert),
            "TLS_KEY": str(paths.switch_key),
            "TRUST_BUNDLE": str(paths.trust_bundle),
            "AUTH_ADDRESS": self.service_address(state.auth),
            "DATA_DIR": str(self.run_dir / cluster / "switch"),
            **self._tls_settings(state, "switch"),
            **self._signer_settings(state, "switch"),
            "OWN_CRL": str(paths.crl),
            # No CA key: the launcher renews the switch's certificate (launcher/renewal.py), which
            # the switch reloads from disk.
        }
        if peer_crl is not None:
            env["PEER_CRL"] = str(peer_crl)
        if peer_address is not None:
            env["PEER_ADDRESS"] = peer_address
        edge_socket = edge_socket_path(self.run_dir, cluster)  # the stages' edges, as records
        env["EDGE_SOCKET"] = str(edge_socket)
        fixed = {"WAN_LISTEN": wan_listen} if wan_listen is not None else {}
        crls = [peer_crl] if isinstance(peer, str) else [each.crl for each in peer]
        own = [paths.switch_cert, paths.switch_key, paths.trust_bundle, paths.crl, *(c for c in crls if c)]
        elsewhere = tuple(p for p in own if not p.is_relative_to(paths.dir))  # an operator's own layout
        sockets = (edge_socket.parent,)
        box = self._box(
            state, "switch", self.run_dir / cluster / "switch", elsewhere, pki=paths, writable=sockets
        )
        state.switch = self.launch(
            f"switch-{cluster}", "services.switch", "NEBULA_SWITCH_", env, SWITCH_PINS, fixed=fixed, box=box
        )
        self._trust(state, state.switch)
        wait_healthy(f"{LOOPBACK}:{state.switch.info['internal_port']}", "nebula.v1.Relay")

    def start_trainer(self, state: ClusterProcesses) -> None:
        cluster = state.cluster_id
        data_dir = self.run_dir / cluster / "trainer"
        box, extra = None, {}
        edge_socket = edge_socket_path(self.run_dir, cluster)  # its stages' edges, as records
        extra["SWITCH_EDGE_SOCKET"] = str(edge_socket)
        if self.boxed is None:
            self.boxed = boxes_enabled()
        if self.boxed:  # its own directories, user and control groups (``trainer_box.py``)
            identity = state.service_tls["trainer"].dir if "trainer" in state.service_tls else None
            state.trainer_box = TrainerBox(data_dir, identity, (*self.shares, edge_socket.parent))
            extra.update(state.trainer_box.prepare())
            box = state.trainer_box.box()
        state.trainer = self.launch(
            f"trainer-{cluster}",
            "services.trainer",
            "NEBULA_TRAINER_",
            {
                "LOG_LEVEL": self.log_level,
                "CLUSTER_ID": cluster,
                # Service-to-service calls go to the mutual-TLS service ports.
                "SWITCH_ADDRESS": self.service_address(state.switch),
                "AUTH_ADDRESS": self.service_address(state.auth),
                "DATA_DIR": str(data_dir),
                "DATA_SERVICE_ADDRESS": self.service_address(state.data),
                **self._tls_settings(state, "trainer"),
                **self._signer_settings(state, "trainer"),
                **extra,
            },
            LISTEN_PINS,
            box=box,
        )
        self._trust(state, state.trainer)
        wait_healthy(self.address(state.trainer), "nebula.v1.Trainer")

    def launch(
        self,
        name: str,
        module: str,
        prefix: str,
        settings: dict[str, str],
        pins: dict[str, str],
        *,
        fixed: dict[str, str] | None = None,
        box: ServiceBox | None = None,
    ) -> ServiceProcess:
        """Start a service on ports of its own (``pinned.launch_pinned``), logging to ``log_dir``."""
        return launch_pinned(name, module, prefix, settings, pins, self.log_dir, fixed=fixed, box=box)


def cluster_endpoints(state: ClusterProcesses) -> ClusterEndpoints:
    urls = {p.name: metrics_url(LOOPBACK, p.info) for p in state.processes()}
    metrics = {name: url for name, url in urls.items() if url}
    return ClusterEndpoints(
        cluster_id=state.cluster_id,
        auth=ClusterLauncher.address(state.auth),
        trainer=ClusterLauncher.address(state.trainer),
        switch=f"{LOOPBACK}:{state.switch.info['internal_port']}",  # type: ignore[union-attr]
        metrics=metrics,
        codec=ClusterLauncher.address(state.codec),
        data=ClusterLauncher.address(state.data),
    )
