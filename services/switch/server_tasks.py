"""The switch's background tasks: the maintenance poll and each link's route sweeper.

Split from server.py so the wiring there stays short: these are the only tasks that run for the
switch's whole life whatever its peers, and each is cancelled on stop before the link and servers go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from nebula_common.auth.verifier import LEEWAY_SECONDS
from nebula_common.service.identity import ServiceIdentity
from services.switch.certs import CertificateManager
from services.switch.config import SwitchSettings
from services.switch.link import PeerLink
from services.switch.peer_trust import PeerTrust
from services.switch.peers import PeerLinks

log = logging.getLogger("services.switch.server")  # the name these records always had
MAINTENANCE_INTERVAL_S = 1.0
"""How often peer trust (bundle, CRL, staleness), live edges' credentials and refusal counts are polled:
a revoked peer or trainer is cut within about this."""
CERT_CHECK_INTERVAL_S = 5.0
"""How often the switch's own certificate files are checked for a change, renewal and expiry."""


async def cancel(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and wait for it to end (an exit-stack callback: the stop waits for the task)."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def maintain(
    settings: SwitchSettings,
    gates: list[tuple[PeerLink, PeerTrust]],
    certs: CertificateManager,
    revoked: Callable[[str, float], str | None],
    revoked_serials: Callable[[], frozenset[int]],
) -> None:
    """Poll each peer's trust (bundle, CRL file, staleness; enforced on its live link), own certificate,
    and the credentials behind live edges (``revoked(account, token iat)``: a disabled account's edges
    end; ``revoked_serials()``: the cluster CA's CRL, a revoked trainer certificate's edges end; a token
    that every verifier refuses by now, its ``exp`` plus the clock-skew leeway past, ends its edges unless
    the trainer renewed them)."""
    loop = asyncio.get_running_loop()
    next_cert_check = loop.time() + CERT_CHECK_INTERVAL_S
    several = len(gates) > 1
    while True:
        await asyncio.sleep(MAINTENANCE_INTERVAL_S)
        try:
            for link, trust in gates:
                peer = {"peer": trust.peer_cluster_id} if several else {}
                for event, details in await asyncio.to_thread(trust.refresh):
                    link.record(event, outcome="alarm" if event == "crl.stale" else "ok", **details, **peer)
                if link.enforce_revocation() and (reason := trust.closed_reason()) is not None:
                    link.record("trust.closed", outcome="refused", reason=reason, **peer)
                link.router.close_revoked(revoked, revoked_serials(), time.time() - LEEWAY_SECONDS)
                if link.refusals is not None:
                    link.refusals.tick()  # a minute's repeated refusals, as one record each
            if loop.time() >= next_cert_check:
                next_cert_check = loop.time() + CERT_CHECK_INTERVAL_S
                await asyncio.to_thread(certs.check)
        except Exception:  # one bad poll must not end revocation enforcement for good
            log.exception("switch maintenance step failed")


def start_background(
    settings: SwitchSettings,
    stack: contextlib.AsyncExitStack,
    links: PeerLinks,
    trusts: dict[str, PeerTrust],
    certs: CertificateManager,
    revocation_reason: Callable[[str, float], str | None],
    identity: ServiceIdentity,
) -> None:
    """Start the maintenance task, then one route sweeper per link; all cancelled on stop, sweepers first."""
    maintenance = asyncio.create_task(
        maintain(
            settings,
            [(each, trusts[each.expected_peer.cluster_id]) for each in links],
            certs,
            revocation_reason,
            lambda: identity.revoked,
        ),
        name="switch-maintenance",
    )
    stack.push_async_callback(cancel, maintenance)
    for each in links:
        sweeper = asyncio.create_task(each.router.run_sweeper(), name=f"route-sweeper-{each.expected_peer}")
        stack.push_async_callback(cancel, sweeper)
