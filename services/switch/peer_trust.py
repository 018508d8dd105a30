"""What this switch holds of its peer organisation: the pinned peer CA and that CA's current CRL.

Between organisations nothing is shared but CA certificates, so revocation cannot arrive by file
copy: the peer's switch sends its CA's CRL over the WAN port (services/switch/crl_exchange.py) and
this class decides whether to believe it. A CRL is accepted only if a CA of this cluster's trust
bundle pinned to this peer (nebula_common/pki/pins.py) signed it, and never replaced by an older one
(a replayed CRL must not un-revoke a certificate) nor by another with the same number. The last
accepted CRL is kept in the switch's data directory so a restart enforces it before the peer is
reachable again. A CRL file (``NEBULA_SWITCH_PEER_CRL``,
the single-operator layout) is still polled and goes through the same checks.

The same object is the link's revocation gate (``PeerLink.revocation``): a peer certificate is
refused when its serial is on the CRL, when no CA pinned to this peer issued it (another peer's CA
vouches for its own cluster only; ``nebula pki trust remove``
took the peer's CA out of the bundle: the live link closes at the next poll), or, with
``fail_closed``, while the CRL is past its nextUpdate or none arrived yet. A stale CRL is always an
alarm (``nebula_switch_crl_stale`` and an error in the log); failing closed is a setting because it
stops all training until the peer publishes a fresh CRL.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from prometheus_client import Gauge

from nebula_common.durable import atomic_write
from nebula_common.pki.crl import CrlError, LoadedCrl, load_crl_for
from nebula_common.pki.identity import cluster_dns_domain
from nebula_common.pki.pins import load_pinned

log = logging.getLogger(__name__)

# One series per peer cluster (label ``peer``): a switch with several peers enforces one CRL each.
PEER_CRL_NUMBER = Gauge(
    "nebula_switch_peer_crl_number",
    "CRLNumber of the peer CA's CRL this switch enforces, per peer.",
    ["peer"],
)
PEER_CRL_STALE = Gauge(
    "nebula_switch_crl_stale",
    "1 while the peer CA's CRL is past its nextUpdate (or none was received), per peer.",
    ["peer"],
)
PEER_CRL_NEXT_UPDATE = Gauge(
    "nebula_switch_peer_crl_next_update_timestamp_seconds",
    "nextUpdate of the peer CA's CRL this switch enforces (unix time; stale after it), per peer.",
    ["peer"],
)
PEER_CRL_REVOKED = Gauge(
    "nebula_switch_peer_crl_revoked", "Serials on the peer CA's CRL this switch enforces, per peer.", ["peer"]
)
PEER_TRUSTED_CAS = Gauge(
    "nebula_switch_peer_trusted_cas",
    "Peer CAs in the trust bundle that may certify the peer, per peer.",
    ["peer"],
)

Event = tuple[str, dict[str, object]]


class _RefusedSerials:
    """Serials the link must not keep: those on the CRL, or every serial while the gate is closed."""

    def __init__(self, trust: PeerTrust) -> None:
        self._trust = trust

    def __contains__(self, serial: object) -> bool:
        return serial in self._trust.crl_serials or self._trust.closed_reason() is not None

    def __iter__(self) -> Iterator[int]:
        return iter(self._trust.crl_serials)

    def __len__(self) -> int:
        return len(self._trust.crl_serials)


class PeerTrust:
    """The peer CA(s) this switch trusts and the CRL it enforces; thread-safe."""

    def __init__(
        self,
        peer_cluster_id: str,
        bundle_path: Path,
        *,
        cache_path: Path,
        crl_file: Path | None = None,
        fail_closed: bool = False,
    ) -> None:
        self.peer_cluster_id = peer_cluster_id
        self.peer_domain = cluster_dns_domain(peer_cluster_id)
        self.bundle_path = Path(bundle_path)
        self.cache_path = Path(cache_path)
        self.crl_file = Path(crl_file) if crl_file is not None else None
        self.fail_closed = fail_closed
        self.loaded: LoadedCrl | None = None
        self.last_error = ""
        self._lock = threading.RLock()
        self._peer_cas: list[x509.Certificate] = []
        self._bundle_stamp: tuple[int, int, int] | None = None
        self._file_stamp: tuple[int, int, int] | None = None
        self._stale_alarm = False
        self._reload_bundle()
        if self.crl_file is not None:
            self._reload_file()
            if self.loaded is None:
                raise CrlError(f"cannot start without a valid peer CRL: {self.last_error}")
        elif self.cache_path.is_file():
            try:
                self.apply(self.cache_path.read_bytes(), source=str(self.cache_path), persist=False)
            except (CrlError, OSError) as exc:
                log.error("ignoring the kept peer CRL %s: %s", self.cache_path, exc)
        self._update_metrics()

    # ------------------------------------------------------------------ state
    @property
    def crl_serials(self) -> frozenset[int]:
        loaded = self.loaded
        return loaded.revoked if loaded is not None else frozenset()

    @property
    def revoked(self) -> _RefusedSerials:
        """What ``PeerLink.enforce_revocation`` checks the live peer's serial against."""
        return _RefusedSerials(self)

    @property
    def peer_cas(self) -> list[x509.Certificate]:
        with self._lock:
            return list(self._peer_cas)

    def is_stale(self, now: datetime | None = None) -> bool:
        loaded = self.loaded
        return loaded is None or loaded.is_stale(now)

    def closed_reason(self, now: datetime | None = None) -> str | None:
        """Why no certificate of the peer is accepted right now, or None when the gate is open."""
        if not self._peer_cas:
            return f"this cluster trusts no CA of peer {self.peer_cluster_id!r} (trust removed)"
        if self.fail_closed:
            if self.loaded is None:
                return f"no CRL of peer {self.peer_cluster_id!r} received yet (fail-closed)"
            if self.loaded.is_stale(now):
                return (
                    f"the CRL of peer {self.peer_cluster_id!r} (#{self.loaded.number}) is past nextUpdate "
                    f"{self.loaded.next_update.isoformat()} (fail-closed)"
                )
        return None

    def refusal(self, cert: x509.Certificate) -> str | None:
        """Why ``cert`` (presented by the peer) must be refused, or None."""
        found = self.check(cert)
        return found[1] if found is not None else None

    def check(self, cert: x509.Certificate) -> tuple[str, str] | None:
        """(audit layer, reason) for refusing ``cert``: ``revoked`` for the CRL and a closed gate,
        ``trust`` for a certificate no CA pinned to this peer issued; None to accept it."""
        if cert.serial_number in self.crl_serials:
            return "revoked", f"peer certificate {cert.serial_number:x} is revoked"
        if (reason := self.closed_reason()) is not None:
            return "revoked", reason
        for ca in self.peer_cas:
            try:
                cert.verify_directly_issued_by(ca)
                return None
            except (InvalidSignature, ValueError, TypeError):
                continue
        return "trust", (
            f"peer certificate {cert.serial_number:x} was not issued by a CA this cluster trusts for "
            f"cluster {self.peer_cluster_id!r}"
        )

    def is_revoked(self, cert: x509.Certificate) -> bool:
        reason = self.refusal(cert)
        if reason is not None:
            log.warning("refusing the peer's certificate: %s", reason)
        return reason is not None

    # ------------------------------------------------------------------ updating
    def apply(self, pem: bytes, *, source: str, persist: bool = True) -> LoadedCrl | None:
        """Verify ``pem`` against the pinned peer CA and enforce it; returns it if it is new.

        Raises ``CrlError`` naming the problem (bad signature, unknown issuer, older number); the
        list in force stays as it was.
        """
        with self._lock:
            loaded = load_crl_for(pem, self._peer_cas, source=source)
            current = self.loaded
            if current is not None and loaded.issuer_key == current.issuer_key:
                if loaded.number < current.number:
                    raise CrlError(
                        f"{source} has CRLNumber {loaded.number}, older than the {current.number} in force"
                    )
                if loaded.pem == current.pem:
                    return None
                if loaded.number == current.number:
                    raise CrlError(
                        f"{source} repeats CRLNumber {loaded.number} with other contents than the CRL in "
                        "force; a CA must number every new CRL higher"
                    )
            self.loaded = loaded
            if persist:
                try:
                    atomic_write(self.cache_path, loaded.pem, mode=0o644)
                except OSError as exc:
                    log.error("could not keep the peer CRL in %s: %s", self.cache_path, exc)
            self._stale_alarm = False
            self._update_metrics()
        return loaded

    def refresh(self, now: datetime | None = None) -> list[Event]:
        """Re-read the trust bundle and the CRL file if they changed, check staleness; audit events."""
        events: list[Event] = []
        if self._reload_bundle():
            events.append(("trust.reload", {"trusted_peer_cas": len(self._peer_cas)}))
        if self.crl_file is not None and (loaded := self._reload_file()) is not None:
            events.append(("crl.reload", {"crl_number": loaded.number, "revoked": len(loaded.revoked)}))
        now = now or datetime.now(UTC)
        loaded = self.loaded
        if loaded is not None and loaded.is_stale(now) and not self._stale_alarm:
            self._stale_alarm = True
            log.error(
                "ALARM: the CRL of peer %s (#%d) is past its nextUpdate %s%s",
                self.peer_cluster_id,
                loaded.number,
                loaded.next_update.isoformat(),
                "; refusing the peer until a fresh one arrives"
                if self.fail_closed
                else "; still enforcing it",
            )
            events.append(
                (
                    "crl.stale",
                    {
                        "crl_number": loaded.number,
                        "next_update": loaded.next_update.isoformat(),
                        "fail_closed": self.fail_closed,
                    },
                )
            )
        self._update_metrics(now)
        return events

    def _reload_bundle(self) -> bool:
        try:
            st = self.bundle_path.stat()
        except FileNotFoundError:
            stamp = None
            pinned = []
        else:
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
            if stamp == self._bundle_stamp:
                return False
            try:
                pinned = load_pinned(self.bundle_path.read_bytes())
            except (OSError, ValueError) as exc:
                log.error(
                    "keeping the previous peer CAs: unreadable trust bundle %s: %s", self.bundle_path, exc
                )
                return False
        if stamp == self._bundle_stamp and stamp is None:
            return False
        with self._lock:
            self._bundle_stamp = stamp
            self._peer_cas = [entry.cert for entry in pinned if entry.may_certify(self.peer_cluster_id)]
        for entry in pinned:
            if entry.peer is None and not entry.may_certify(self.peer_cluster_id):
                log.error(
                    "CA %r in %s certifies %s: rebuild the bundle with `nebula pki trust add`",
                    entry.cert.subject.rfc4514_string(),
                    self.bundle_path,
                    entry.scope(),
                )
        log.info(
            "trust bundle loaded: %d CA(s) may certify peer %s", len(self._peer_cas), self.peer_cluster_id
        )
        return True

    def _reload_file(self) -> LoadedCrl | None:
        assert self.crl_file is not None
        try:
            st = self.crl_file.stat()
        except FileNotFoundError:
            self.last_error = f"peer CRL {self.crl_file} is missing"
            log.error("%s; keeping the last loaded list", self.last_error)
            return None
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp == self._file_stamp:
            return None
        try:
            loaded = self.apply(self.crl_file.read_bytes(), source=str(self.crl_file), persist=False)
        except (CrlError, OSError) as exc:
            self.last_error = str(exc)
            log.error("refusing peer CRL update: %s", exc)
            return None
        self._file_stamp = stamp
        return loaded

    def _update_metrics(self, now: datetime | None = None) -> None:
        loaded = self.loaded
        peer = self.peer_cluster_id
        PEER_TRUSTED_CAS.labels(peer).set(len(self._peer_cas))
        PEER_CRL_STALE.labels(peer).set(1 if self.is_stale(now) else 0)
        PEER_CRL_NUMBER.labels(peer).set(loaded.number if loaded is not None else 0)
        if loaded is not None:
            PEER_CRL_NEXT_UPDATE.labels(peer).set(loaded.next_update.timestamp())
        PEER_CRL_REVOKED.labels(peer).set(len(loaded.revoked) if loaded is not None else 0)
