"""The peer CA's revocation list, as the switch enforces it.

The CRL file is polled (every ``crl_refresh_s``, one ``stat`` per poll) rather than watched with
inotify so it works the same on bind mounts, Kubernetes projected volumes (which swap a symlink)
and plain files. A CRL is only accepted if a CA of the trust bundle signed it; a bad or missing
update keeps the last good list in force, because forgetting revocations on a broken file would
fail open.
"""

from __future__ import annotations

import logging
from pathlib import Path

from cryptography import x509
from prometheus_client import Gauge

from nebula_common.pki.crl import CrlError, LoadedCrl, load_crl_for

log = logging.getLogger(__name__)

CRL_REVOKED = Gauge("nebula_switch_crl_revoked_certificates", "Serials on the loaded peer CRL.")
CRL_SECONDS_TO_NEXT_UPDATE = Gauge(
    "nebula_switch_crl_seconds_to_next_update", "Seconds until the loaded peer CRL is stale."
)


class RevocationList:
    """The current set of revoked peer serials, reloaded from ``path`` when it changes."""

    def __init__(self, path: Path, bundle_path: Path) -> None:
        self.path = Path(path)
        self.bundle_path = Path(bundle_path)
        self._stamp: tuple[int, int, int] | None = None
        self.loaded: LoadedCrl | None = None
        self.last_error = ""
        self.refresh()
        if self.loaded is None:
            raise CrlError(f"cannot start without a valid peer CRL: {self.last_error}")

    @property
    def revoked(self) -> frozenset[int]:
        return self.loaded.revoked if self.loaded is not None else frozenset()

    def is_revoked(self, cert: x509.Certificate) -> bool:
        return cert.serial_number in self.revoked

    def refresh(self) -> LoadedCrl | None:
        """Reload if the file changed; returns the new list when it was (re)loaded."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self.last_error = f"peer CRL {self.path} is missing"
            log.error("%s; keeping the last loaded list", self.last_error)
            return None
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp == self._stamp:
            return None
        try:
            trusted = x509.load_pem_x509_certificates(self.bundle_path.read_bytes())
            loaded = load_crl_for(self.path.read_bytes(), trusted, source=str(self.path))
        except (CrlError, OSError, ValueError) as exc:
            self.last_error = str(exc)
            log.error("refusing peer CRL update: %s", exc)
            return None
        if self.loaded is not None and loaded.number < self.loaded.number:
            log.error(
                "refusing peer CRL %s: number %d is older than %d",
                self.path,
                loaded.number,
                self.loaded.number,
            )
            return None
        self._stamp = stamp
        self.loaded = loaded
        CRL_REVOKED.set(len(loaded.revoked))
        if loaded.is_stale():
            log.warning("peer CRL %s is past its nextUpdate %s", self.path, loaded.next_update.isoformat())
        return loaded
