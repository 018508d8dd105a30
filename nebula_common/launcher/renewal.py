"""The launcher renews its services' internal certificates: no service process holds a CA key.

A deployment started by ``nebula local up`` or ``nebula cluster up`` keeps each cluster's CA in the
operator's PKI directory. The launcher (the operator's process, which lives as long as the deployment)
is the one issuer: every ``interval_s`` it re-issues each service leaf that has a third of its life
left, is revoked or is missing (``ensure_service_certificates``, audited ``cert.issue``), and the
switch's WAN certificate once a third of its life is left (``renew_switch_certificate``, audited
``cert.renew``). Each service picks its new files up before its next handshake (no restart, no
dropped call). Every ``CRL_CHECK_S`` it also copies the cluster CA's CRL into each service's own
directory (``mirror_crl``): a boxed service sees only that directory of the PKI. A service
compromised through its own code can therefore present only its own identity:
it cannot mint another service's, or the switch's, because it never held the key to do so.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

from cryptography import x509

from nebula_common.pki.lifecycle import renew_switch_certificate
from nebula_common.pki.service_identity import ensure_service_certificates, mirror_crl, renewal_due
from nebula_common.pki.store import ClusterPaths

log = logging.getLogger(__name__)

RENEW_CHECK_S = 60.0
"""How often the leaves are looked at (they live 24 h and are renewed with 8 h left)."""
CRL_CHECK_S = 1.0
"""How often the cluster's CRL is compared with each service's copy (a revocation reaches them this late)."""
MIN_VALIDITY = timedelta(hours=1)
"""A renewed switch certificate lives as long as the one it replaces, and at least this."""


class LeafRenewer:
    """A daemon thread of the launcher renewing every cluster's service leaves when due."""

    def __init__(self, pki_dir: Path, clusters: Sequence[str], interval_s: float = RENEW_CHECK_S) -> None:
        self.pki_dir = Path(pki_dir)
        self.clusters = tuple(clusters)
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leaf-renewer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def step(self) -> None:
        """Renew what is due now, cluster by cluster; a failure is logged and tried again next time."""
        for cluster in self.clusters:
            try:
                ensure_service_certificates(self.pki_dir, cluster)
                self._switch(cluster)
            except Exception as exc:  # the services keep their current leaves; say why, retry later
                log.warning("cannot renew the internal certificates of cluster %s: %s", cluster, exc)

    def mirror(self) -> None:
        """Bring each service's copy of its cluster's CRL up to date (a failure: logged, retried)."""
        for cluster in self.clusters:
            try:
                mirror_crl(self.pki_dir, cluster)
            except OSError as exc:
                log.warning("cannot copy the CRL of cluster %s to its services: %s", cluster, exc)

    def _switch(self, cluster: str) -> None:
        path = ClusterPaths.for_cluster(self.pki_dir, cluster).switch_cert
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        if renewal_due(cert):
            lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
            renew_switch_certificate(self.pki_dir, cluster, validity=max(lifetime, MIN_VALIDITY))

    def _run(self) -> None:
        due = time.monotonic() + self.interval_s
        while not self._stop.wait(min(CRL_CHECK_S, self.interval_s)):
            self.mirror()
            if time.monotonic() >= due:
                self.step()
                due = time.monotonic() + self.interval_s

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)


__all__ = ["CRL_CHECK_S", "RENEW_CHECK_S", "LeafRenewer"]
